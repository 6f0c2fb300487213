"""Two gloo processes on the CPU: Ulysses attention compiled with backend="graphar" equals eager.

The blocks are written as Ulysses code is (tests/_ulysses.py: in-place c10d all-to-alls with heads
at dim 2; functional collectives with heads at dim 1), so the pass has to find the exchanges itself.
Blocks whose values are small integers are compared bit for bit (every sum is exact in any order);
the softmax block is compared within float tolerance, since Inductor compiles its arithmetic
differently from eager.

Shapes that vary from call to call (sequence, batch) make the default torch.compile recompile the
second shape with dynamic sizes: that graph must get the static graph's rewrites, and serve the
third shape without another compile.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from graphar import processes
from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked
from tests._ulysses import UlyssesBlock, exact_attention, seq_to_heads_dim1

WORLD = 2


def _block(heads: int, kv_heads: int, d: int, dtype: torch.dtype, exact: bool) -> UlyssesBlock:
    """The shared block with seeded weights: small integers for `exact`, else scaled normal ones."""
    gen = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int) -> torch.Tensor:
        w = torch.randint(-2, 3, (rows, cols), generator=gen) if exact else torch.randn(rows, cols, generator=gen)
        return w.to(dtype) / (1 if exact else rows**0.5)

    return UlyssesBlock(heads, kv_heads, d, weight, exact)


class HeadsFirstBlock(torch.nn.Module):
    """xDiT-style: [b, h, s, d] tensors, functional all-to-alls; exact arithmetic."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (seq_to_heads_dim1(t) for t in (q, k, v))
        return q - 3 * k + v


class ExchangedTwice(torch.nn.Module):
    """Q, K and V exchanged, then their results exchanged again (two levels of Ulysses)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (seq_to_heads_unpacked(seq_to_heads_unpacked(t)) for t in (q, k, v))
        return q - 3 * k + v


class ReturnsExchanged(torch.nn.Module):
    """The exchanged Q, K and V leave the graph (as before a graph break): eager's strides too."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(seq_to_heads_unpacked(t) for t in (q, k, v))


def _integers(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _compile_and_run(model: torch.nn.Module, *args: torch.Tensor) -> tuple[torch.Tensor, str]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphar", fullgraph=True)
    out, code = run_and_get_code(compiled, *args)
    return out, "\n".join(code)


def _check(rank: int, name: str, expected: torch.Tensor, actual: torch.Tensor, code: str, exact: bool) -> None:
    if "graphar.qkv_all_to_all" not in code:
        raise AssertionError(f"rank {rank} {name}: the compiled code has no graphar.qkv_all_to_all")
    if exact and not torch.equal(actual, expected):
        raise AssertionError(f"rank {rank} {name}: compiled output differs from eager")
    if not exact:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")


def _worker(rank: int, world_size: int) -> None:
    _init()
    try:
        with torch.no_grad():
            for name, dtype, b, heads, kv_heads, exact in (
                ("exact fp32 b=1", torch.float32, 1, 4, 4, True),
                ("exact bf16 b=2 gqa", torch.bfloat16, 2, 4, 2, True),
                ("attention fp32 b=2 gqa", torch.float32, 2, 4, 2, False),
            ):
                model = _block(heads, kv_heads, 8, dtype, exact)
                x = (
                    _integers(b, 6, heads * 8, dtype=dtype, seed=rank)
                    if exact
                    else torch.randn(b, 6, heads * 8, generator=torch.Generator().manual_seed(rank)).to(dtype)
                )
                actual, code = _compile_and_run(model, x)
                if "graphar.heads_to_seq_all_to_all" not in code:
                    raise AssertionError(f"rank {rank} {name}: the output exchange was not rewritten")
                _check(rank, name, model(x), actual, code, exact)
            qkv = [_integers(2, 4, 6, 8, dtype=torch.float32, seed=10 * rank + i) for i in range(3)]
            actual, code = _compile_and_run(HeadsFirstBlock(), *qkv)
            _check(rank, "heads at dim 1", HeadsFirstBlock()(*qkv), actual, code, exact=True)
            qkv = [_integers(2, 4, 8, 8, dtype=torch.float32, seed=10 * rank + i) for i in range(3)]
            actual, code = _compile_and_run(ExchangedTwice(), *qkv)
            _check(rank, "exchanged twice", ExchangedTwice()(*qkv), actual, code, exact=True)
            assert code.count("graphar.qkv_all_to_all.default(") == 2, f"rank {rank}: both levels packed"
            actual, code = _compile_and_run(ReturnsExchanged(), *qkv)
            for got, expected in zip(actual, ReturnsExchanged()(*qkv)):
                _check(rank, "returns the exchanged", expected, got, code, exact=True)
                assert got.stride() == expected.stride(), (
                    f"rank {rank}: strides {got.stride()}, eager {expected.stride()}"
                )
    finally:
        dist.destroy_process_group()


def _init() -> None:
    import graphar  # noqa: F401  (registers the backend and the ops)

    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the pass under test


def test_compiled_ulysses_equals_eager_on_gloo() -> None:
    processes.run(_worker, WORLD, collective_timeout_s=120)


def separate_qkv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Ulysses attention taking Q, K and V as separate inputs (Dynamo gives each a symbol of its own)."""
    q, k, v = (seq_to_heads_unpacked(t) for t in (q, k, v))
    return heads_to_seq_unpacked(exact_attention(q, k, v))


def _rewrites_per_call(
    rank: int, name: str, model: Callable[..., torch.Tensor], calls: list[tuple[torch.Tensor, ...]]
) -> list[dict[str, int]]:
    """Compile `model` once (default torch.compile: a new shape recompiles with dynamic sizes), call it
    with each argument tuple, check each output against eager; the graphar ops each call compiled in."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphar", fullgraph=True)
    counts = []
    for args in calls:
        before = Counter(counters["graphar"])
        actual = compiled(*args)
        counts.append(dict(Counter(counters["graphar"]) - before))
        if not torch.equal(actual, model(*args)):
            raise AssertionError(f"rank {rank} {name}: compiled output differs from eager at {args[0].shape}")
    return counts


def _dynamic_worker(rank: int, world_size: int) -> None:
    _init()

    def hidden(b: int, s: int) -> tuple[torch.Tensor]:
        return (_integers(b, s, 32, dtype=torch.float32, seed=rank),)

    def qkv(s: int) -> tuple[torch.Tensor, ...]:
        return tuple(_integers(1, s, 4, 8, dtype=torch.float32, seed=10 * rank + i) for i in range(3))

    block = _block(4, 2, 8, torch.float32, exact=True)
    # Ops per call: a compile gets both exchanges whether static (first call) or dynamic (a call with
    # a new sequence or batch); a call served by the dynamic graph compiles nothing.
    both = {"qkv_all_to_all": 1, "heads_to_seq_all_to_all": 1}
    cases = {
        "q, k, v inputs, sequence 8, 16, 24": (separate_qkv_attention, [qkv(s) for s in (8, 16, 24)], [both, both, {}]),
        "block, sequence 24, 16, 8, then batch 2, 3": (
            block,
            [hidden(1, s) for s in (24, 16, 8)] + [hidden(b, 8) for b in (2, 3)],
            [both, both, {}, both, {}],
        ),
    }
    try:
        with torch.no_grad():
            for name, (model, calls, expected) in cases.items():
                counts = _rewrites_per_call(rank, name, model, calls)
                if counts != expected:
                    raise AssertionError(f"rank {rank} {name}: graphar ops per call {counts}, expected {expected}")
    finally:
        dist.destroy_process_group()


def test_dynamic_shapes_keep_the_rewrites_on_gloo() -> None:
    processes.run(_dynamic_worker, WORLD, collective_timeout_s=120)
