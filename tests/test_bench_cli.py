"""`python bench/NAME.py --dry-run`: the table of fake numbers and the PNG beside it.

With matplotlib (CI installs it through the `test` extra) every benchmark writes a real plot; without
it (simulated by hiding the module) the table is written all the same and a line says how to get the
plot. Also: where results go by default, the charts built from a benchmark's own results, progress
lines, each benchmark's options, a benchmark run as a script, partial reports, the ranks' agreement
on what to measure (two gloo processes) and a world of one without a process group (the one-GPU
benchmarks), each benchmark's NCCL timeout against graphar's exchange timeout, and what
the one-GPU benchmarks run, on the CPU: the chunking benchmark's emulated exchanges around graphar's
own pipelined attention, the pack benchmark's swept launches under the Triton interpreter.
"""

import dataclasses
import importlib.util
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import allreduce
import common
import plot
import ranks
from graphar import processes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parent.parent
HEADINGS = {
    "allreduce": "# All-reduce latency (us)",
    "attention": "# Ulysses attention block",
    "capture": "# Capture cost of BatchGraphs",
    "chunking": "# Chunking tax",
    "compile": "# Compile time",
    "decode": "# Decode step",
    "norm": "# Fused all-reduce",
    "norm_local": "# Fused norm, local part",
    "pack": "# Ulysses pack kernel",
    "ulysses": "# Ulysses all-to-all",
}


def bench(name: str, *argv: str) -> int:
    """`python bench/NAME.py ARGV`, in this process."""
    return common.run(importlib.import_module(name), list(argv))


def assert_real_png(path: Path) -> None:
    """A PNG that matplotlib drew: the signature, a header of plausible size, and coloured marks
    (lines or bars) on the page, not a blank or text-only image."""
    from matplotlib import image

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 400, (width, height)
    assert len(data) > 10_000
    rgb = image.imread(path)[..., :3]
    assert rgb.std() > 0.05
    assert ((rgb.max(-1) - rgb.min(-1)) > 0.3).mean() > 0.005  # saturated pixels: the data, in colour


@pytest.mark.parametrize("name", list(HEADINGS))
def test_dry_run_writes_the_table_and_a_plot(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / f"{name}.md"
    assert bench(name, "--dry-run", "--quick", "--out", str(out)) == 0
    text = out.read_text()
    assert text.startswith(HEADINGS[name]) and "\n|---|" in text
    assert_real_png(out.with_suffix(".png"))
    printed = capsys.readouterr().out
    assert f"written to {out}\nplot written to {out.with_suffix('.png')}\n" in printed


def test_decode_checks_every_graphar_variant_against_inductor(tmp_path: Path) -> None:
    out = tmp_path / "decode.md"
    assert bench("decode", "--dry-run", "--out", str(out)) == 0
    header = next(line for line in out.read_text().splitlines() if line.startswith("| batch"))
    assert all(f"max abs diff (a, {v})" in header for v in "bde")


@pytest.mark.parametrize("name", list(HEADINGS))
def test_a_report_where_nothing_was_measured_is_written(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first partial report of a run whose first unit failed: every cell a string, no point to plot."""
    module = importlib.import_module(name)
    calls: list[tuple] = []
    monkeypatch.setattr(module, "write", lambda *args: calls.append(args))
    assert bench(name, "--dry-run", "--quick", "--out", str(tmp_path / "x.md")) == 0
    monkeypatch.undo()
    cells, *rest = calls[0]
    module.write(dict.fromkeys(cells, "err"), *rest, final=False)
    assert (tmp_path / "x.md").read_text().startswith(HEADINGS[name])
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "x.png").read_bytes()[:8] == PNG_SIGNATURE


def test_a_partial_report_goes_to_the_files_only_and_a_failing_plot_costs_only_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "x.md"
    common.write_report("# partial", path, [], "title", final=False)
    assert path.read_text() == "# partial" and capsys.readouterr().out == ""

    def broken(*args: object) -> str:
        raise ValueError("no positive values on a log axis")

    monkeypatch.setattr(plot, "write_png", broken)
    common.write_report("# final", path, [], "title")
    assert path.read_text() == "# final"
    assert "plot not written: ValueError: no positive values on a log axis" in capsys.readouterr().out


def test_without_matplotlib_the_table_is_written_and_says_how_to_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: the import raises
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert bench("decode", "--dry-run", "--out", str(tmp_path)) == 0
    table = tmp_path / "decode-cpu-ws2.md"  # --out a folder: the usual name inside it
    assert table.read_text().startswith(HEADINGS["decode"])
    assert not table.with_suffix(".png").exists()
    assert "plot not written: matplotlib is not installed (pip install 'graphar[plot]'" in capsys.readouterr().out


def test_results_go_to_bench_results_unless_out_says(tmp_path: Path) -> None:
    assert common.results_path("ulysses", "NVIDIA H200", 4, None) == REPO / "bench" / "results" / "ulysses-h200-ws4.md"
    assert common.results_path("chunking", "NVIDIA H200", None, tmp_path) == tmp_path / "chunking-h200.md"
    assert common.results_path("ulysses", "NVIDIA H200", 4, tmp_path / "x.md") == tmp_path / "x.md"


def test_the_all_reduce_chart_is_built_from_the_results_not_the_markdown() -> None:
    s = allreduce.Settings(
        sizes=[16 << 10, 16 << 20], dtype="bf16", modes=["graph", "eager"], ops=1, replays=1, eager_iters=1
    )
    results = {(mode, n, name): 10.0 for mode in s.modes for n in s.sizes for name in allreduce.column_names(mode)}
    results[("graph", 16 << 20, allreduce.G_AUTO)] = "-"  # refused: a gap in its line
    results.update({("eager", n, allreduce.NCCL): "n/a" for n in s.sizes})  # unavailable: no points
    (chart,) = allreduce.charts(results, s)
    assert isinstance(chart, plot.LineChart) and chart.log
    lines = {line.label: line for line in chart.lines}
    assert len(lines) == len(allreduce.column_names("graph")) + len(allreduce.column_names("eager"))
    assert lines["graphar auto, graph"].points == [(16 << 10, 10.0)]
    assert lines["NCCL, eager"].points == []
    assert (lines["NCCL, graph"].colour_key, lines["NCCL, graph"].dash_key) == ("NCCL", "graph")
    assert [label for _, label in chart.xticks] == ["16 KB", "16 MB"]


def test_progress_lines_carry_the_seconds_and_only_rank_0_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(common, "_progress", common._Progress(start=time.time() - 12.5))
    common.progress("done 16 KB (1/4)")
    assert re.fullmatch(r"\[\s+12\.\d s\] done 16 KB \(1/4\)\n", capsys.readouterr().out)
    monkeypatch.setattr(common, "_progress", common._Progress(active=False))
    common.progress("done 16 KB (1/4)")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("allreduce", ["--sizes", "--dtype", "--modes"]),
        ("decode", ["--batches", "--layers", "--steps", "--replays"]),
        ("ulysses", ["--shapes"]),
    ],
)
def test_each_benchmark_keeps_its_options(name: str, options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench(name, "--help")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python bench/{name}.py")
    for option in options + ["--world-size", "--quick", "--dry-run", "--out"]:
        assert f" {option}" in out, option


def test_a_bad_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench("allreduce", "--dry-run", "--modes", "graph,warp")
    assert exit_info.value.code == 2
    assert "unknown modes ['warp']" in capsys.readouterr().err


def test_a_benchmark_runs_as_a_script(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ulysses.py"), "--dry-run", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ulysses-cpu-ws2.md").read_text().startswith(HEADINGS["ulysses"])
    assert f"written to {tmp_path / 'ulysses-cpu-ws2.md'}" in out.stdout


def test_the_compile_benchmark_times_both_backends_and_the_pass_on_the_cpu(tmp_path: Path) -> None:
    """`bench compile --quick` end to end, in a process of its own (its fake process group, its
    compiles): every row timed, the pass's share and its rewrites, the machine and commit, a plot."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "compile.md"
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no pool of compile workers to start
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "compile.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert text.startswith(HEADINGS["compile"])
    assert all(f"{key}: " in text for key in ("CPU", "torch", "graphar", "commit"))
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| llama", "| dit"))]
    assert [(row[0], row[1]) for row in rows] == [("| llama", "2"), ("| llama", "4"), ("| dit", "2")]
    for row in rows:
        inductor_s, graphar_s, passes_s = map(float, row[2:5])
        assert inductor_s > 0 and graphar_s > passes_s > 0
        assert float(row[5].rstrip("%")) == pytest.approx(100 * passes_s / graphar_s, abs=0.5)
    assert [row[7] for row in rows] == [
        "all_reduce 4 |",
        "all_reduce 8 |",
        "heads_to_seq_all_to_all 2, qkv_all_to_all 2 |",
    ]
    assert_real_png(out.with_suffix(".png"))


def test_graphar_s_exchanges_give_up_on_a_dead_peer_before_nccl_does() -> None:
    """A benchmark's hang ends with graphar's own error naming the peer, not NCCL's watchdog."""
    for name in HEADINGS:
        module = importlib.import_module(name)
        if hasattr(module, "TIMEOUT_S"):  # else: in this process, one GPU or the CPU, no NCCL
            assert float(common.EXCHANGE_TIMEOUT_S) < module.TIMEOUT_S, name


def _all_ranks_on_cpu(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


@dataclasses.dataclass
class _Units:
    units: list[int]


def _agreement_worker(rank: int, world_size: int) -> None:
    ranks.all_ranks = _all_ranks_on_cpu  # gloo: the flag on the CPU
    try:
        reasons: dict[str, str] = {}
        timed: list[object] = []

        def capture() -> str:
            if rank == 1:
                raise RuntimeError("capture failed")
            return "graph"

        # One rank's failure: neither times (the timing holds collectives), both say why.
        assert ranks.measured(capture, timed.append, "capture", reasons, "col") == "err" and timed == []
        assert reasons == {"col": "capture raised on rank 1: RuntimeError: capture failed"}
        assert ranks.measured(lambda: "graph", lambda graph: 2.0 + rank, "capture", reasons, "col") == 2.0 + rank
        assert ranks.verdict(lambda: "WRONG" if rank == 1 else None, "check", reasons, "c") == "WRONG"
        assert ranks.verdict(lambda: None, "check", reasons, "c") is None
        made = {"all_reduce_add_rms_norm": 2} if rank == 0 else {}
        assert ranks.rewritten(made, "all_reduce_add_rms_norm", reasons, "(d)") == "not rewritten"
        assert reasons["(d)"] == "not rewritten: no all_reduce_add_rms_norm rewrite, rewrites {}"
        assert ranks.rewritten({"all_reduce_add_rms_norm": 1}, "all_reduce_add_rms_norm", reasons, "(e)") is None
        # After each unit, rank 0 gets the cells so far (max over ranks) to write.
        written: list[tuple] = []
        common.run_units(
            [1, 2],
            str,
            lambda unit: {(unit, "t"): float(unit + rank)},
            lambda cells, done, final: written.append((dict(cells), done, final)),
        )
        expected = [({(1, "t"): 2.0}, [1], False), ({(1, "t"): 2.0, (2, "t"): 3.0}, [1, 2], True)]
        assert written == (expected if rank == 0 else [])
        # A benchmark's report so far: its settings cut to the units done, to its results file.
        calls: list[tuple] = []
        report = common.reporter("t", _Units([1, 2]), "units", lambda *args: calls.append(args), reasons, Path("out"))
        report({(1, "t"): 2.0}, [1], False)
        path = common.results_path("t", common.gpu_name(), 2, Path("out"))
        assert calls == [({(1, "t"): 2.0}, _Units([1]), 2, reasons, common.gpu_name(), path, False)]
    finally:
        dist.destroy_process_group()


def test_the_ranks_agree_on_what_to_measure() -> None:
    processes.run(_agreement_worker, 2, collective_timeout_s=60)


def test_alone_the_helpers_serve_a_world_of_one(tmp_path: Path) -> None:
    """Without a process group (the one-GPU benchmarks) every decision is this process's own, the
    report is written after each unit, and its file is named for the GPU alone."""
    assert not dist.is_initialized() and ranks.alone()
    reasons: dict[str, str] = {}

    def fails() -> None:
        raise RuntimeError("capture failed")

    assert ranks.measured(fails, lambda graph: 1.0, "capture", reasons, "col") == "err"
    assert reasons == {"col": "capture raised on rank 0: RuntimeError: capture failed"}
    assert ranks.verdict(lambda: "WRONG", "check", reasons, "c") == "WRONG"
    written: list[tuple] = []
    report = common.reporter(
        "t", _Units([1, 2]), "units", lambda cells, *rest: written.append((dict(cells), *rest)), reasons, tmp_path
    )
    common.run_units([1, 2], str, lambda unit: {(unit, "t"): float(unit)}, report)
    path = tmp_path / f"t-{common.gpu_slug(common.gpu_name())}.md"
    assert [(w[0], w[1], w[2], w[5], w[6]) for w in written] == [
        ({(1, "t"): 1.0}, _Units([1]), 1, path, False),
        ({(1, "t"): 1.0, (2, "t"): 2.0}, _Units([1, 2]), 1, path, True),
    ]


def test_reports_name_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(common.COMMIT_ENV, raising=False)
    common.git_commit.cache_clear()
    try:
        assert re.fullmatch(r"[0-9a-f]{7,}( \+ uncommitted changes)?|n/a", common.header("m", 2)["commit"])
        monkeypatch.setenv(common.COMMIT_ENV, "abc1234 (carried)")  # a copy without .git is told
        common.git_commit.cache_clear()
        assert common.header("m", 2)["commit"] == "abc1234 (carried)"
    finally:
        common.git_commit.cache_clear()


def test_the_one_gpu_benchmarks_need_a_gpu_but_not_for_a_dry_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("chunking", "pack"):
        with pytest.raises(SystemExit, match="needs a GPU"):
            bench(name, "--quick")


def test_the_capture_benchmark_builds_a_serving_loop_s_sizes() -> None:
    import capture

    sizes, quick = capture.SERVING_BATCHES, capture.QUICK_BATCHES
    assert len(sizes) == len(set(sizes)) == 64 and (min(sizes), max(sizes)) == (1, 512)
    assert quick == sorted(quick) and set(quick) <= set(sizes)


def test_the_chunking_benchmark_times_graphar_s_own_pipelined_attention() -> None:
    """Its emulated exchanges feed graphar.ulysses.overlap.ulysses_attention (CPU: no streams): every
    chunk count the plan keeps attends as the unchunked call does, in both modes, and the op's
    output is written where the output exchange would write it (copy mode)."""
    import chunking
    from shapes import Shape

    for shape in (Shape(1, 64, 8, 16, causal=True), Shape(2, 32, 8, 16, kv_heads=4)):
        emu = chunking.Emulated(shape, 2, device="cpu", dtype=torch.float32)
        q, k, v = (x.transpose(1, 2) for x in emu.qkv)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.kv != shape.heads)
        with emu.patched():
            whole = emu.attended(1)
            torch.testing.assert_close(whole, want.transpose(1, 2))
            for n in (2, 4) if shape.kv == shape.heads else (2,):
                assert torch.equal(emu.attended(n), whole), (shape, n)
                emu.prepare(n)
                out = emu.call(n, chunking.COPY)
                # Copy mode: the output exchange's bytes, tokens j*S.. of every head to rank j (here: this rank's).
                p, s_local = 2, shape.s // 2
                expected = whole.unflatten(1, (p, s_local)).permute(0, 2, 1, 3, 4)  # [b, S, P, h_rank, d]
                got = out.unflatten(2, (n, p, shape.heads // (p * n))).permute(0, 1, 3, 2, 4, 5).flatten(3, 4)
                assert torch.equal(got, expected), (shape, n)
                assert emu.call(n, chunking.NONE).shape == emu.q_in.shape
            with pytest.raises(RuntimeError, match="not into 3"):  # a count the plan does not keep is refused
                emu.prepare(3)
                emu.call(3, chunking.NONE)
    from graphar.ulysses import shapes

    assert getattr(shapes.world_size, "__self__", None) is None  # the patches end with the block


_PACK_CHECK = """
import sys

sys.path.insert(0, sys.argv[1])  # bench/
import torch
import pack
from shapes import Shape

for shape in (Shape(2, 10, 4, 16, kv_heads=2), Shape(1, 6, 4, 8)):
    for op in pack.OPS:
        lay = pack.layout(op, shape, 2, lambda nbytes: 2, device="cpu")
        if lay is None:
            assert op == "gather_sequence" and shape.b == 1
            continue
        pairs = pack.recorded(lambda: lay.run(1))
        for dst, src in pairs:
            dst.copy_(src)
        reference = lay.out(1).clone()
        runs = {"kernel": lambda: lay.run(1), **{t: pack.tiled(pairs, t) for t in ((2048, 4), (64, 1))}}
        for name, run in runs.items():
            lay.out(1).fill_(float("nan"))
            run()
            assert torch.equal(lay.out(1), reference), (shape, op, name)
        lay.out(0).fill_(float("nan"))  # nothing written: the check says so
        assert pack.wrong(lambda i: None, lay, lay.out(1), "tiles") == "WRONG"
        assert "x" in pack.launch_tiles(pairs)
print("ok")
"""


def test_the_pack_benchmark_s_launches_move_graphar_s_bytes() -> None:
    """Under the Triton interpreter (chosen at import, so in a process of its own): the kernel as
    graphar calls it and as the sweep launches it with other tiles write what torch's copy_ writes."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-c", _PACK_CHECK, str(REPO / "bench")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-3000:] + run.stderr[-3000:]
