"""diffusers' context parallelism as its docs turn it on, `enable_parallelism(config=
ContextParallelConfig(ulysses_degree=2))` on two gloo ranks, compiled with backend="graphar", with
and without graphar's `attention_chunks`: a tiny random Wan and a tiny random Flux transformer.
diffusers' Ulysses attention exchanges Q, K and V with three all_to_all_single and the output with a
fourth; graphar packs the three and rewrites the fourth, or with attention_chunks pipelines all of
it with the attention between (graphar::ulysses_attention)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from tests.clients._harness import Run, Setting, check, measured, run_ranks

diffusers = pytest.importorskip("diffusers")

CHUNKS = (0, 2)


def wan() -> tuple[torch.nn.Module, dict[str, Any]]:
    """2 blocks, 4 heads of 16; a 2-frame 8x8 latent: 32 tokens, 16 a rank."""
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    )
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=gen),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
    )
    return model, inputs


def flux() -> tuple[torch.nn.Module, dict[str, Any]]:
    """One double-stream and one single-stream block, 4 heads of 16; 32 image and 8 text tokens."""
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 32, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
        pooled_projections=torch.randn(1, 32, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=torch.randn(32, 3, generator=gen),
        txt_ids=torch.zeros(8, 3),
    )
    return model, inputs


def enable_ulysses(model: torch.nn.Module) -> None:
    # diffusers 0.42 puts rank r on device r % torch.accelerator.device_count() while it resolves the
    # config, and that count is 0 on a CPU-only torch (ZeroDivisionError). The gloo ranks share one
    # device, the CPU: count it as one there; elsewhere the patch returns the true count.
    count = torch.accelerator.device_count() or 1
    with mock.patch("torch.accelerator.device_count", return_value=count):
        model.enable_parallelism(config=diffusers.ContextParallelConfig(ulysses_degree=2))


def _compiled(
    name: str,
    model: torch.nn.Module,
    inputs: dict[str, Any],
    want: torch.Tensor,
    setting: Setting,
    backend: str,
    chunks: int = 0,
) -> Run:
    with measured(name) as result:
        compiled = setting.compile(model, backend, options={"attention_chunks": chunks})
        result.compare(compiled(**inputs, return_dict=False)[0], want)
    return result


def run(rank: int, setting: Setting) -> list[Run]:
    """Each model compiled with each CHUNKS; where that breaks the graph, with backend="inductor" too,
    to compare the breaks."""
    runs = []
    for build in (wan, flux):
        torch.manual_seed(0)
        model, inputs = build()
        model = model.to(setting.device, setting.dtype).eval()
        inputs = {k: v.to(setting.device, setting.dtype if v.is_floating_point() else None) for k, v in inputs.items()}
        enable_ulysses(model)
        name = f"diffusers {build.__name__}"
        with torch.no_grad():
            want = model(**inputs, return_dict=False)[0]
            graphar_runs = [
                _compiled(f"{name} attention_chunks={c}", model, inputs, want, setting, "graphar", c) for c in CHUNKS
            ]
            runs += graphar_runs
            if any(r.graph_breaks for r in graphar_runs):
                runs.append(_compiled(f"{name} backend=inductor", model, inputs, want, setting, "inductor"))
    return runs


def _worker(rank: int) -> None:
    runs = {r.name: r for r in run(rank, Setting())}
    for model in ("wan", "flux"):
        inductor = runs.get(f"diffusers {model} backend=inductor")
        # Per attention over the sequence (Wan's self-attention in each of 2 blocks, Flux's joint one in
        # its 2): the Q/K/V triplet packed and the output exchange rewritten; with chunks, both taken
        # into one pipelined attention. Wan's cross-attention reads the text whole: no exchange. The
        # output's all-gather (diffusers' hook on proj_out) is left.
        left = {"all_gather_into_tensor": 1}
        check(
            runs[f"diffusers {model} attention_chunks=0"],
            {"qkv_all_to_all": 2, "heads_to_seq_all_to_all": 2},
            left,
            inductor,
        )
        check(runs[f"diffusers {model} attention_chunks=2"], {"ulysses_attention": 2}, left, inductor)
    # Wan's context-parallel hook logs a warning on a 1-D timestep, which breaks the graph under any backend.
    assert "diffusers wan backend=inductor" in runs, "the Wan run should have shown how graph breaks compare"


def test_diffusers_context_parallel() -> None:
    run_ranks(_worker)
