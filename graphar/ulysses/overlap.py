"""Ulysses attention with its exchanges behind the attention: the heads in chunks, pipelined.

`ulysses_attention(q, k, v, group_name, ...)` is the sequence -> heads exchange of Q, K and V, the
scaled-dot-product attention and the heads -> sequence exchange of its output, as one call on
`[b, S, h, d]` tensors (the local sequence, all heads). The heads are split into `chunks` runs of
consecutive heads (K/V heads alike, so GQA groups stay whole). Chunk c's input exchange, attention
and output exchange form a pipeline: while chunk c's attention runs on the caller's stream, chunk
c+1's input exchange and chunk c-1's output exchange run on a side stream, forked at the start and
joined at the end. Every chunk's tensors live until the join, so no memory is reused early on
either stream, in eager calls and in CUDA-graph captures alike.

Heads are independent in attention, and each head travels and is attended exactly as in the
unchunked path, on the same kernel, so the result is the unchunked one bit for bit. Which rank
attends which head differs (chunk c's heads spread over every rank), which changes nothing in the
output. Flash can round a head by how many heads share the call (it splits a small problem's keys
over thread blocks): with it (or SDPA's own pick, which may be flash), chunks stay large enough
that flash never splits them, and a small problem is not chunked.

How many chunks: `chunks` asks for at most that many; `AUTO_CHUNKS` (the option
attention_chunks="auto") lets `auto_chunks` pick per shape from the measured chunking tax.
`planned_chunks` is the whole decision, from shapes alone, so every rank takes it alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphar.ulysses import exchanges, shapes

_side_streams: dict[int, torch.cuda.Stream] = {}


def chunk_count(q_heads: int, kv_heads: int, world_size: int, wanted: int) -> int:
    """The most chunks, up to `wanted`, that split both head counts evenly over every rank."""
    return max(
        c for c in range(1, max(1, wanted) + 1) if q_heads % (c * world_size) == 0 and kv_heads % (c * world_size) == 0
    )


# ---- how many chunks: attention_chunks="auto" -------------------------------------------------------
# The automatic rule (the op's chunks=AUTO_CHUNKS): the most chunks, up to AUTO_MAX_CHUNKS, that leave
# each chunk at least AUTO_MIN_ROWS[kernel] query rows (batch x the rank's heads x the whole sequence),
# AUTO_CAUSAL_FACTOR times that for causal attention (a causal row attends half the keys on average:
# half the work per row against the same fixed costs per call). Chunking pays per chunk (a launch, a
# tail wave, the pipeline's ramp), so it can only win where chunks stay large. The constants are read
# from the chunking tax that `python bench/chunking.py` measures, bench/results/chunking-h200.md
# (its notes suggest each kernel's threshold: the smallest chunk at or above which every measured shape
# keeps the tax within 3 %). A threshold stands only where two runs on one H200 (a quick one and the
# full one, whose run-to-run noise is a few percent) both kept the tax within 3 %: efficient on
# Wan-sized attention (655K query rows a rank) at 2 chunks (-0.6 %, +0.2 %). Flash there was +1.2 %
# then +5.2 % at 2 chunks, cuDNN +4.1 % then +1.6 %, and every smaller shape paid more at every
# count, so neither has a threshold, nor SDPA's own pick (None), which takes flash on Hopper. A kernel
# without a threshold is never chunked automatically.
AUTO_CHUNKS = -1
AUTO_MAX_CHUNKS = 4
AUTO_MIN_ROWS: dict[str | None, int] = {"efficient": 327_600}
AUTO_CAUSAL_FACTOR = 2


def auto_chunks(batch: int, q_heads: int, seq: int, kernel: str | None, is_causal: bool) -> int:
    """The chunks the measured rule wants for attention of `batch` x `q_heads` heads (one rank's share)
    over `seq` tokens (the whole sequence, every rank's) on SDPA's `kernel` ("flash", "cudnn",
    "efficient"; None: SDPA's own pick): the most, up to AUTO_MAX_CHUNKS, that keep each chunk at
    least AUTO_MIN_ROWS[kernel] query rows (AUTO_CAUSAL_FACTOR times more when causal); 1 (unchunked)
    where no count does, and for a kernel without a threshold. `planned_chunks` then rounds it down to
    a count that splits the heads evenly."""
    least = AUTO_MIN_ROWS.get(kernel)
    if least is None:
        return 1
    least *= AUTO_CAUSAL_FACTOR if is_causal else 1
    return max(1, min(AUTO_MAX_CHUNKS, batch * q_heads * seq // least))


def planned_chunks(
    batch: int,
    q_heads: int,
    kv_heads: int,
    seq: int,
    world_size: int,
    wanted: int,
    kernel: str | None,
    is_causal: bool,
    on_gpu: bool,
) -> int:
    """The chunks `ulysses_attention` runs when asked for at most `wanted` (AUTO_CHUNKS: `auto_chunks`'
    pick) for `q_heads` and `kv_heads` heads (all ranks') over `seq` tokens (the whole sequence) on
    `world_size` ranks: shapes alone decide, so every rank decides alike."""
    local = q_heads // world_size
    if wanted == AUTO_CHUNKS:
        wanted = auto_chunks(batch, local, seq, kernel, is_causal)
    # On a GPU, flash (or SDPA's own pick, which may be flash) attends whole chunks only; the CPU's
    # flash attends each head alike, whatever shares the call.
    if kernel in ("flash", None) and on_gpu:
        wanted = _flash_chunks(wanted, batch, local, seq)
    return chunk_count(q_heads, kv_heads, world_size, wanted)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group_name: str,
    is_causal: bool = False,
    scale: float | None = None,
    chunks: int = 2,
    kernel: str | None = None,
) -> torch.Tensor:
    """softmax(Q K^T * scale) V over the whole sequence, for `[b, S, h, d]` local-sequence Q, K, V
    (K and V may have fewer heads: GQA); returns `[b, S, hq, d]`, new contiguous memory. `chunks`:
    at most this many chunks of heads (AUTO_CHUNKS: as many as the measured rule picks; see
    `planned_chunks`). `kernel` ("flash", "efficient", "cudnn", "math"): the SDPA backend to attend
    with where it takes the chunk's inputs (the one the replaced graph ran); SDPA's own pick otherwise."""
    p = shapes.world_size(group_name)
    hq, hk = q.shape[2], k.shape[2]
    n = planned_chunks(q.shape[0], hq, hk, q.shape[1] * p, p, chunks, kernel, is_causal, q.is_cuda)
    counts = [hq // (p * n), hk // (p * n), hk // (p * n)]  # a chunk's Q, K, V heads on each rank
    backends = _preferring(kernel)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    inputs: list[torch.Tensor] = []  # every chunk's tensors stay alive until the streams join
    outputs: list[torch.Tensor] = []
    with _pipeline(q.device) as (side, mark):
        arrived = []
        for c in range(n):
            with side():
                inputs.append(exchanges.qkv_exchange([_chunk(x, c, n) for x in (q, k, v)], group_name))
                arrived.append(mark())
        for c in range(n):
            arrived[c].wait()
            qh, kh, vh = (x.transpose(1, 2) for x in shapes.split_heads(inputs[c], counts))
            outputs.append(_attention(qh, kh, vh, is_causal, scale, kernel, backends))
            attended = mark()
            with side():
                attended.wait()
                exchanges.output_exchange(outputs[c].transpose(1, 2), group_name, out=_chunk(out, c, n))
    return out


# SDPA's backends in its default order of preference, each with the switch users turn it off by.
_BACKENDS = {
    "flash": (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
    "math": (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled),
    "cudnn": (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled),
}


def _preferring(kernel: str | None) -> list[SDPBackend] | None:
    """SDPA's backends, `kernel`'s first (the kernel the replaced graph ran), then the others the user
    left on, should it not take a chunk's inputs; None: SDPA's own pick."""
    if kernel is None:
        return None
    return [
        _BACKENDS[kernel][0],
        *(backend for name, (backend, enabled) in _BACKENDS.items() if name != kernel and enabled()),
    ]


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    kernel: str | None,
    backends: list[SDPBackend] | None,
) -> torch.Tensor:
    """SDPA of `[b, h, S, d]` heads on `backends` (`_preferring(kernel)`). GQA as the replaced graph
    fed `kernel`: flash attends fewer K/V heads natively; the other kernels got each K/V head repeated
    (HF's repeat_kv, or math's own), so they get that."""
    gqa = k.shape[1] != q.shape[1]
    if gqa and backends is not None and kernel != "flash":
        r = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1), False
    pinned = sdpa_kernel(backends, set_priority=True) if backends is not None else contextlib.nullcontext()
    # In q's dtype, as the op's output is: an eager call under autocast would attend in another dtype,
    # whose bytes the output exchange would then copy into q's.
    with torch.autocast(q.device.type, enabled=False), pinned:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)


# Flash splits the keys of a small problem over thread blocks (a heuristic over batch x heads x query
# blocks against the GPU's SMs), so a chunk of fewer heads could round otherwise than all heads at
# once. Each chunk keeps at least this many query blocks (rows of 128 at most per block; more than
# any GPU graphar runs on has SMs), which flash takes whole, as it takes the unchunked problem.
_FLASH_WHOLE_BLOCKS = 160


def _flash_chunks(wanted: int, batch: int, q_heads: int, seq: int) -> int:
    """At most `wanted` chunks of `q_heads` heads (per rank) that flash attends whole over `seq` tokens;
    shapes alone decide, so every rank decides alike. One (no pipelining) for a small problem, which
    has little to hide anyway."""
    blocks = batch * q_heads * -(-seq // 128)
    return max(1, min(wanted, blocks // _FLASH_WHOLE_BLOCKS))


def _chunk(x: torch.Tensor, c: int, n: int) -> torch.Tensor:
    """Chunk c of n runs of consecutive heads (dim 2)."""
    h = x.shape[2]
    return x[:, :, h * c // n : h * (c + 1) // n]


class _Mark:
    """A point in one stream's work that another stream can wait for (no-op on the CPU)."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


@contextlib.contextmanager
def _pipeline(device: torch.device) -> Iterator[tuple]:
    """(side, mark): `side()` is a context running on the side stream; `mark()` records where the
    current stream is. The side stream is forked from the caller's stream on entry and joined on exit."""
    if device.type != "cuda":
        yield contextlib.nullcontext, lambda: _Mark(None)
        return
    # Marks, waits and the attention use the current device's streams: make it the tensors' device.
    with torch.cuda.device(device):
        main = torch.cuda.current_stream(device)
        side = _side_streams.get(device.index)
        if side is None:
            side = _side_streams[device.index] = torch.cuda.Stream(device)
        side.wait_stream(main)  # in a capture this forks the side stream into it

        def mark() -> _Mark:
            event = torch.cuda.Event()
            event.record()
            return _Mark(event)

        try:
            yield (lambda: torch.cuda.stream(side)), mark
        finally:
            main.wait_stream(side)
