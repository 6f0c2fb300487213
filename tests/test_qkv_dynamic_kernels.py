"""The Triton relayout kernel compiles once for every sequence length and batch, and a pushing pack
ends with a system-scope fence; both checked with no GPU.

Triton compiles a kernel per specialisation key: its constexprs and, for each other argument, its
type and what it is specialised on (an int equal to 1 or divisible by 16, a pointer aligned to 16
bytes). The key is computed here with Triton's own binder for a CUDA target, for each layout of
`graphar.ulysses.pack` at several sequence lengths (odd ones too) and batches, with real head dims:
each layout must have one key, so a new length never compiles (in a CUDA-graph capture, say).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from graphar.ulysses import pack  # noqa: E402
from graphar.ulysses.shapes import packed_heads  # noqa: E402

P = 2
HEADS, KV_HEADS = 8, 4


def _binder():
    """Triton's argument binder for the kernel on an sm_90 target; skips where this Triton differs."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.runtime.jit import create_function_from_signature

        kernel = pack._relayout_kernel
        backend = backends["nvidia"].compiler(GPUTarget("cuda", 90, 32))
        return create_function_from_signature(kernel.signature, kernel.params, backend)
    except (ImportError, AttributeError, KeyError, TypeError) as e:
        pytest.skip(f"this Triton computes its keys differently: {e}")


def _layouts(b: int, s: int, d: int) -> dict[str, list[pack.Pair]]:
    """(dst, src) pairs of each layout for batch b, local sequence s and head dim d (as the ops make them)."""
    xs = [torch.empty(b, s, h, d) for h in (HEADS, KV_HEADS, KV_HEADS)]
    packed = torch.empty(P, b, s, packed_heads([x.shape[2] for x in xs], P), d)
    pairs, offset = [], 0
    for x in xs:
        h = x.shape[2] // P
        pairs.append((packed[:, :, :, offset : offset + h], x.unflatten(2, (P, h)).permute(2, 0, 1, 3, 4)))
        offset += h
    o = torch.empty(b, P * s, HEADS // P, d)
    recv = torch.empty(P, b, s, HEADS // P, d)
    # Pushed: chunk j shifted into rank j's buffer, or into the output, by distances between
    # allocations, which move with every output: small here, past 2**31 elements there.
    far = 3 << 30 if (b + s) % 2 else 16
    shifts = tuple(j * far - (1 << 28) for j in range(P))
    pushed = [(pack.Shifted(dst[0], shifts), src) for dst, src in pairs]
    return {
        "pack_heads": pairs,
        "pack_heads pushed": pushed,
        "gather_sequence": [
            (torch.empty(b, P * s, packed.shape[3], d).unflatten(1, (P, s)).permute(1, 0, 2, 3, 4), packed)
        ],
        "pack_sequence": [(recv, o.unflatten(1, (P, s)).permute(1, 0, 2, 3, 4))],
        "gather_heads": [(torch.empty(b, s, HEADS, d).unflatten(2, (P, HEADS // P)).permute(2, 0, 1, 3, 4), recv)],
    }


@pytest.mark.parametrize("d", [64, 128])
def test_one_kernel_for_every_sequence_and_batch(d: int) -> None:
    binder = _binder()
    keys: dict[str, set[tuple[str, ...]]] = {}
    for b in (1, 2, 3):
        for s in (8, 16, 24, 17, 1000):
            for name, pairs in _layouts(b, s, d).items():
                _, args, constants = pack._launch(pairs, None)
                _, specialization, _ = binder(*args, **constants)
                keys.setdefault(name, set()).add(tuple(map(str, specialization)))
    assert {name: len(k) for name, k in keys.items()} == dict.fromkeys(keys, 1)


def test_a_pushing_pack_fences_its_stores_before_it_ends() -> None:
    """Stores into peers' buffers are followed by fence.sc.sys in every thread, after the last store of
    every branch (the all-to-all's entry barrier, in the next kernel, announces them); a pack into
    local memory has none."""
    binder = _binder()
    from triton.backends.compiler import GPUTarget

    def ptx(pairs: list[pack.Pair], guard: torch.Tensor | None = None) -> list[str]:
        _, args, constants = pack._launch(pairs, guard)
        _, specialization, _ = binder(*args, **constants)
        params = pack._relayout_kernel.params
        source = triton.compiler.ASTSource(
            fn=pack._relayout_kernel,
            signature={p.name: kind for p, (kind, _) in zip(params, specialization)},
            constexprs={(i,): v for i, (kind, v) in enumerate(specialization) if kind == "constexpr"},
        )
        return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"].splitlines()

    layouts = _layouts(1, 16, 128)
    pushed = ptx(layouts["pack_heads pushed"])
    stores = [i for i, line in enumerate(pushed) if "st.global" in line]
    fences = [i for i, line in enumerate(pushed) if "fence.sc.sys" in line]
    assert stores and fences and min(fences) > max(stores), (stores[-3:], fences)
    assert not any("fence.sc.sys" in line for line in ptx(layouts["pack_heads"]))
    # An exchange's pack reads its communicator's failed flag before its first store (the lease, csrc/all_to_all.cuh).
    guarded = ptx(layouts["pack_heads pushed"], torch.zeros(1, dtype=torch.int32))
    loads = [i for i, line in enumerate(guarded) if "ld.volatile.global" in line]
    stores = [i for i, line in enumerate(guarded) if "st.global" in line]
    assert loads and stores and min(loads) < min(stores), (loads[:3], stores[:3])
    assert not any("ld.volatile" in line for line in pushed)
