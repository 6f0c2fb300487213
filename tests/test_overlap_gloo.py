"""Two gloo processes on the CPU: the pipelined Ulysses attention (graphar.ulysses.overlap) equals the
unchunked path bit for bit (separate all-to-alls as yunchang writes them, attention, the output
all-to-all), for GQA, causal and not, one to four chunks and the automatic count, batch 1 and 2;
and a Ulysses block compiled with `attention_chunks` gets the op and matches eager (the
projections' rounding aside)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from graphar import processes

WORLD = 2


def _unchunked(q, k, v, is_causal, scale):
    from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked

    qh, kh, vh = (seq_to_heads_unpacked(x).transpose(1, 2) for x in (q, k, v))
    o = F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=is_causal, scale=scale, enable_gqa=k.shape[2] != q.shape[2]
    )
    return heads_to_seq_unpacked(o.transpose(1, 2).contiguous())


def _compiled_block(rank: int) -> None:
    """A Ulysses block compiled with attention_chunks finds the attention and equals eager."""
    from torch._dynamo.utils import counters

    from tests._ulysses import UlyssesBlock, heads_to_seq_dim1, seq_to_heads_dim1

    torch._inductor.config.fx_graph_cache = False  # the pass must run to be counted
    gen = torch.Generator().manual_seed(7)  # weights equal on both ranks
    block = UlyssesBlock(8, 4, 16, lambda r, c: torch.randn(r, c, generator=gen) / 8, exact=False)
    x = torch.randn(2, 6, 128, generator=torch.Generator().manual_seed(rank))
    compiled = torch.compile(block, backend="graphar", options={"attention_chunks": 2}, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(x), block(x)
    assert counters["graphar"]["ulysses_attention"] == 1, dict(counters["graphar"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def xdit(q, k, v):  # heads at dim 1, functional collectives
        qh, kh, vh = (seq_to_heads_dim1(t) for t in (q, k, v))
        return heads_to_seq_dim1(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))

    qkv = [torch.randn(2, 8, 6, 16, generator=torch.Generator().manual_seed(rank + i)) for i in range(3)]
    compiled = torch.compile(xdit, backend="graphar", options={"attention_chunks": 2}, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(*qkv), xdit(*qkv)
    assert counters["graphar"]["ulysses_attention"] == 2, dict(counters["graphar"])
    assert torch.equal(got, want), "heads at dim 1: the pipelined attention differs from eager"

    def hf_gqa(q, k, v):  # K/V repeated as HF's repeat_kv does
        from graphar.ulysses.unpacked import heads_to_seq_unpacked, seq_to_heads_unpacked

        qh, kh, vh = (seq_to_heads_unpacked(t).transpose(1, 2) for t in (q, k, v))
        kh, vh = (t[:, :, None].expand(-1, -1, 2, -1, -1).flatten(1, 2) for t in (kh, vh))
        return heads_to_seq_unpacked(F.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2))

    gen = torch.Generator().manual_seed(rank)
    qkv = [torch.randn(1, 6, h, 16, generator=gen) for h in (8, 4, 4)]
    compiled = torch.compile(hf_gqa, backend="graphar", options={"attention_chunks": 2}, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(*qkv), hf_gqa(*qkv)
    assert counters["graphar"]["ulysses_attention"] == 3, dict(counters["graphar"])
    assert torch.equal(got, want), "GQA repeated as HF does: the pipelined attention differs from eager"


def _worker(rank: int, world_size: int) -> None:
    import graphar  # noqa: F401  (registers the ops)
    from graphar.ulysses import overlap

    try:
        name = dist.group.WORLD.group_name
        for b, (hq, hk), is_causal, chunks in itertools.product(
            (1, 2), ((8, 8), (8, 4)), (False, True), (1, 2, 4, overlap.AUTO_CHUNKS)
        ):
            gen = torch.Generator().manual_seed(100 * rank + b)
            q = torch.randn(b, 6, hq, 16, generator=gen)
            k, v = (torch.randn(b, 6, hk, 16, generator=gen) for _ in range(2))
            scale = 0.3 if chunks == 2 else None
            got = torch.ops.graphar.ulysses_attention(q, k, v, name, is_causal, scale, chunks)
            want = _unchunked(q, k, v, is_causal, scale)
            what = f"b={b} heads={hq}/{hk} causal={is_causal} chunks={chunks}"
            assert got.shape == q.shape and got.is_contiguous(), what
            assert torch.equal(got, want), f"{what}: differs from the unchunked path"
        assert overlap.chunk_count(8, 4, WORLD, 4) == 2 and overlap.chunk_count(24, 8, WORLD, 3) == 2
        # A direct call under autocast attends in the inputs' dtype, which the op returns (autocast
        # would attend in bfloat16, whose bytes the output exchange cannot put into float32).
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = torch.ops.graphar.ulysses_attention(q, k, v, name, is_causal, scale, 2)
        assert got.dtype == q.dtype and torch.equal(got, _unchunked(q, k, v, is_causal, scale)), "under autocast"
        _compiled_block(rank)
    finally:
        dist.destroy_process_group()


def test_pipelined_attention_equals_the_unchunked_path() -> None:
    processes.run(_worker, WORLD, collective_timeout_s=120)


def test_flash_pipelines_only_what_it_attends_whole() -> None:
    """A chunk of fewer heads must keep enough query blocks that flash does not split its keys (it
    would round otherwise than the unchunked call): small problems are not chunked."""
    from graphar.ulysses.overlap import _flash_chunks

    assert _flash_chunks(2, 2, 8, 512) == 1  # 64 query blocks in all
    assert _flash_chunks(2, 1, 12, 4096) == 2  # DiT-like: 192 blocks a chunk
    assert _flash_chunks(4, 1, 8, 8192) == 3  # 4 would leave 128 a chunk


def test_the_automatic_rule_chunks_only_large_problems(monkeypatch) -> None:
    """attention_chunks="auto": the most chunks, up to the limit, that keep each chunk its kernel's
    rows (twice as many when causal); 1 below that, and for a kernel the rule has no threshold for."""
    from graphar.ulysses import overlap

    monkeypatch.setattr(overlap, "AUTO_MIN_ROWS", {"flash": 1000, "cudnn": 4000, None: 1000})
    monkeypatch.setattr(overlap, "AUTO_MAX_CHUNKS", 4)
    monkeypatch.setattr(overlap, "AUTO_CAUSAL_FACTOR", 2)
    assert overlap.auto_chunks(1, 10, 100, "flash", False) == 1  # 1000 rows: one chunk's worth
    assert overlap.auto_chunks(1, 10, 299, "flash", False) == 2
    assert overlap.auto_chunks(2, 10, 300, "flash", False) == 4  # 6000 rows, but at most 4
    assert overlap.auto_chunks(2, 10, 300, "flash", True) == 3  # causal: 2000 rows a chunk
    assert overlap.auto_chunks(2, 10, 300, "cudnn", False) == 1
    assert overlap.auto_chunks(1, 1000, 1000, "math", False) == 1  # no threshold: never chunked
    # planned_chunks: the pick rounded down to a count that splits every rank's heads evenly, and
    # capped for flash on a GPU (each chunk keeps 160 query blocks: 3 here, not 4).
    assert overlap.planned_chunks(1, 40, 40, 10_000, 2, overlap.AUTO_CHUNKS, "cudnn", False, True) == 4
    assert overlap.planned_chunks(1, 24, 24, 10_000, 2, overlap.AUTO_CHUNKS, "cudnn", False, True) == 4
    assert overlap.planned_chunks(1, 20, 20, 10_000, 2, overlap.AUTO_CHUNKS, "cudnn", False, True) == 2
    assert overlap.planned_chunks(1, 16, 16, 8192 * 8, 2, overlap.AUTO_CHUNKS, "flash", False, True) == 4
    assert overlap.planned_chunks(1, 16, 16, 8192, 2, 4, "flash", False, True) == 2  # 3 blocks-wise, 2 evenly
    assert overlap.planned_chunks(1, 16, 16, 8192, 2, 4, "flash", False, False) == 4  # the CPU's flash


def test_attention_feeds_gqa_as_the_graph_s_kernel_was_fed() -> None:
    """Flash takes fewer K/V heads itself; the other kernels got them repeated (HF's repeat_kv), and
    the op repeats them likewise: either way each query head attends its group's K/V head."""
    import torch.nn.functional as F

    from graphar.ulysses.overlap import _attention, _preferring

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 16, 8, generator=gen) for h in (4, 2, 2))
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    for kernel in (None, "flash", "efficient", "cudnn", "math"):  # the CPU runs its own kernel for each
        got = _attention(q, k, v, True, None, kernel, _preferring(kernel))
        torch.testing.assert_close(got, want, msg=str(kernel))


def test_the_measured_rule_picks_what_the_h200_table_allows() -> None:
    """The committed constants against bench/results/chunking-h200.md: only Wan-sized attention on the
    efficient kernel chunks, in 2, the one count within 3 % in both runs; flash, cuDNN and SDPA's own pick,
    which missed it in one run or the other, never chunk."""
    from graphar.ulysses import overlap

    wan, flux, llama_16k = (1, 20, 32760, False), (1, 12, 4608, False), (1, 16, 16384, True)
    assert [overlap.auto_chunks(*wan[:3], k, wan[3]) for k in ("flash", "efficient", "cudnn", None)] == [1, 2, 1, 1]
    for shape in (flux, llama_16k):
        assert {overlap.auto_chunks(*shape[:3], k, shape[3]) for k in ("flash", "efficient", "cudnn", None)} == {1}
