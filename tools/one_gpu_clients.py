"""The client libraries of tests/clients with two ranks sharing ONE GPU, bf16 (a harness, not a test).

Each client runs as its CPU test runs it (the same code: tests/clients), here on cuda:0 over a gloo
group with graphar's set-up relaxed as tools/one_gpu_check.py relaxes it, and prints graphar's
rewrites, the largest difference from the uncompiled model and the graph breaks. The gpt-fast decode
loop runs with mode="reduce-overhead" (its graphs hold graphar's ops only), and its decode step also
captured by graphar.graph; transformers' tp_plan="auto", diffusers' Ulysses and torchtitan's DTensor
TP in the default mode: each keeps an all-gather on the group's collective, gloo here, which a CUDA
graph cannot capture (NCCL's can). It says nothing about speed. Usage, from the checkout after
`pip install -e ".[clients]"`: python tools/one_gpu_clients.py [CLIENT ...] (the test modules' names,
e.g. test_gpt_fast; default all; exit code 0: every client ran)
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for tests.clients

from tests.clients._harness import Setting, run_ranks

BF16 = dict(device="cuda", dtype=torch.bfloat16)
# Client test module, the setting it runs in here.
CLIENTS = {
    "test_transformers_tp": Setting(**BF16),
    "test_gpt_fast": Setting(**BF16, mode="reduce-overhead"),
    "test_diffusers_cp": Setting(**BF16),
    "test_torchtitan_tp": Setting(**BF16),
}


def _setup(rank: int) -> None:
    from one_gpu_check import _init_relaxed

    os.environ["LOCAL_RANK"] = "0"  # every rank on cuda:0 (transformers binds the device LOCAL_RANK names)
    torch.cuda.set_device(0)
    _init_relaxed()
    _gathers_through_the_cpu()


_kept: list[torch.library.Library] = []  # a Library's registrations last as long as the object


def _gathers_through_the_cpu() -> None:
    """gloo's functional all-gather of CUDA tensors crashes (SIGSEGV in wait_tensor, torch 2.11 on one
    H200: transformers' and torchtitan's DTensor and diffusers' unshard all hit it), a fault of this
    harness's gloo group, not of the clients: on GPUs NCCL serves these collectives, which graphar leaves
    to the group anyway. Here CUDA all-gathers and reduce-scatters go through the CPU: an all-gather moves
    the same bits; a reduce-scatter sums in fp32 there, which may round a 16-bit sum differently."""
    ops = torch.ops._c10d_functional
    lib = torch.library.Library("_c10d_functional", "IMPL")
    _kept.append(lib)

    def all_gather(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        return ops.wait_tensor(ops.all_gather_into_tensor(x.cpu(), group_size, group_name)).to(x.device)

    def all_gather_out(x: torch.Tensor, group_size: int, group_name: str, *, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(all_gather(x, group_size, group_name))

    def reduce_scatter(x: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
        cpu = ops.reduce_scatter_tensor(x.float().cpu(), reduce_op, group_size, group_name)
        return ops.wait_tensor(cpu).to(x.device, x.dtype)

    lib.impl("all_gather_into_tensor", all_gather, "CUDA")
    lib.impl("all_gather_into_tensor_out", all_gather_out, "CUDA")
    lib.impl("reduce_scatter_tensor", reduce_scatter, "CUDA")


def _captured_decode(rank: int) -> str:
    """gpt-fast's decode step compiled in the default mode and captured by graphar.graph (zero-copy
    all-reduces), replayed at a new position against the uncompiled step."""
    import graphar
    from tests.clients import test_gpt_fast as gf

    torch.manual_seed(0)
    model = gf._shard(gf.Transformer(), rank).to(**BF16)
    model.setup_caches(2)
    step = torch.compile(gf.decode_one_token, backend="graphar", fullgraph=True)
    token, pos = torch.zeros(2, 1, dtype=torch.long, device="cuda"), torch.tensor([0], device="cuda")
    with torch.no_grad():
        for _ in range(2):
            step(model, token, pos)  # compile, and set the group up outside the capture
        graph = torch.cuda.CUDAGraph()
        with graphar.graph(graph):
            out = step(model, token, pos)
        token.fill_(7)
        pos.fill_(1)
        graph.replay()
        diff = (out.float() - gf.decode_one_token(model, token, pos).float()).abs().max().item()
    return f"gpt-fast decode step in graphar.graph: max diff {diff:.3g}"


def _client(name: str):
    """The client's test module, or None where its library is not installed."""
    try:
        return importlib.import_module(f"tests.clients.{name}")
    except pytest.skip.Exception:
        return None


def _worker(rank: int, names: list[str], checkpoints: str) -> None:
    failed = []
    for name in names:
        try:
            args = (checkpoints,) if name == "test_transformers_tp" else ()
            lines = [r.summary() for r in _client(name).run(rank, CLIENTS[name], *args)]
            if name == "test_gpt_fast":
                lines.append(_captured_decode(rank))
        except Exception:  # noqa: BLE001  (a harness: report, go on with the next client)
            lines = [f"{name}: FAILED\n{traceback.format_exc()}"]
            failed.append(name)
        if rank == 0 or failed:
            print("\n".join(f"[rank {rank}] {line}" for line in lines), flush=True)
    if failed:
        raise SystemExit(f"rank {rank}: failed: {', '.join(failed)}")


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    asked = sys.argv[1:] or list(CLIENTS)
    unknown = set(asked) - set(CLIENTS)
    if unknown:
        print(f"unknown clients {sorted(unknown)}: choose from {list(CLIENTS)}")
        return 2
    names = [name for name in asked if _client(name) is not None]
    with tempfile.TemporaryDirectory() as checkpoints:
        if "test_transformers_tp" in names:
            _client("test_transformers_tp").save_checkpoints(Path(checkpoints))
        run_ranks(_worker, names, checkpoints, setup=_setup)
    print(f"one-GPU clients: every one of {', '.join(names)} ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
