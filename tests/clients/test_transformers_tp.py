"""transformers' tensor parallelism as its docs turn it on (a checkpoint loaded with
`distributed_config=DistributedConfig(tp_plan="auto")` under torchrun's environment, two gloo ranks)
and compiled with backend="graphar": a tiny random Llama, prefill then decode steps with its
StaticCache, and a tiny Qwen3-MoE prefill. transformers sums each row-parallel projection's output
with an in-place dist.all_reduce, which graphar rewrites. (`tp_plan="auto"` straight to
from_pretrained still works in 5.23 but warns it is deprecated for DistributedConfig, which the docs
now show.)"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.clients._harness import Run, Setting, check, measured, run_ranks

transformers = pytest.importorskip("transformers")

PROMPT, DECODE_STEPS = 6, 3


def configs() -> dict[str, transformers.PretrainedConfig]:
    """Tiny configs: 2 layers, hidden 64, 4 query heads and 2 K/V heads (2 and 1 a rank)."""
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    return {
        "llama": transformers.LlamaConfig(**common),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1
        ),
    }


def save_checkpoints(folder: Path) -> None:
    """Random-init checkpoints, as from_pretrained reads a downloaded one."""
    for name, config in configs().items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / name)


def _steps(model, tokens: torch.Tensor, decode: bool) -> list[torch.Tensor]:
    """Logits of a prefill and, with `decode`, of decode steps fed the next tokens (the same tokens for
    eager and compiled: greedy picks could differ on a near tie), with the StaticCache that compiled
    generation uses."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=tokens.shape[1])
    logits = [model(tokens[:, :PROMPT], past_key_values=cache).logits.clone()]  # CUDA graphs reuse their outputs
    for i in range(PROMPT, tokens.shape[1] if decode else PROMPT):
        logits.append(model(tokens[:, i : i + 1], past_key_values=cache).logits.clone())
    return logits


def run(rank: int, setting: Setting, folder: str) -> list[Run]:
    runs = []
    tokens = torch.randint(0, 128, (2, PROMPT + DECODE_STEPS), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(setting.device)
    for name in configs():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            Path(folder) / name,
            dtype=setting.dtype,
            distributed_config=transformers.DistributedConfig(tp_plan="auto"),  # tp_size: WORLD_SIZE
        )
        decode = name == "llama"
        with torch.no_grad():
            want = _steps(model, tokens, decode)
            with measured(f"transformers {name}") as result:
                # dynamic=False: prefill and decode compile once each. A decode step compiled with a
                # symbolic length fails in DTensor's vocab-parallel embedding (backend="inductor" too).
                for got, expected in zip(_steps(setting.compile(model, dynamic=False), tokens, decode), want):
                    result.compare(got, expected)
        runs.append(result)
    return runs


def _worker(rank: int, folder: str) -> None:
    llama, moe = run(rank, Setting(), folder)
    # Per graph: the vocab-parallel embedding's sum, and each layer's o_proj and down_proj (MoE: its
    # experts' down_proj) rewritten; the lm_head's all-gather of the logits left. Llama compiles two
    # graphs, prefill and decode, rewritten alike.
    check(llama, {"all_reduce": 2 * (1 + 2 * 2)}, {"all_gather_into_tensor": 2})
    check(moe, {"all_reduce": 1 + 2 * 2}, {"all_gather_into_tensor": 1})


def test_transformers_tp_plan_auto() -> None:
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoints(Path(folder))
        run_ranks(_worker, folder)
