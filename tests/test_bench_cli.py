"""`python -m graphar bench NAME --dry-run`: the table of fake numbers and the PNG beside it.

With matplotlib (CI installs it through the `test` extra) every benchmark writes a real plot; without
it (simulated by hiding the module) the table is written all the same and a line says how to get the
plot. Also: where results go by default, the charts built from a benchmark's own results, progress
lines, and the `python bench/NAME.py` entry points of a checkout.
"""

import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphar.__main__ import main
from graphar.benchmarks import allreduce, common, plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parent.parent
HEADINGS = {"allreduce": "# All-reduce latency (us)", "attention": "# Ulysses attention block",
            "decode": "# Decode step", "norm": "# Fused all-reduce",
            "ulysses": "# Ulysses all-to-all"}


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
    assert main(["bench", name, "--dry-run", "--quick", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith(HEADINGS[name]) and "\n|---|" in text
    assert_real_png(out.with_suffix(".png"))
    printed = capsys.readouterr().out
    assert f"written to {out}\nplot written to {out.with_suffix('.png')}\n" in printed


def test_without_matplotlib_the_table_is_written_and_says_how_to_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: the import raises
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["bench", "decode", "--dry-run", "--out", str(tmp_path)]) == 0
    table = tmp_path / "decode-cpu-ws2.md"  # --out a folder: the usual name inside it
    assert table.read_text().startswith(HEADINGS["decode"])
    assert not table.with_suffix(".png").exists()
    assert "plot not written: matplotlib is not installed (pip install 'graphar[plot]'" in capsys.readouterr().out


def test_results_go_to_bench_results_of_a_checkout_else_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "bench").mkdir(parents=True)
    (checkout / "setup.py").touch()
    monkeypatch.setattr(common, "PACKAGE_DIR", checkout / "graphar")  # graphar run from a checkout
    assert common.results_dir() == checkout / "bench" / "results"
    monkeypatch.setattr(common, "PACKAGE_DIR", tmp_path / "site-packages" / "graphar")  # installed
    monkeypatch.chdir(tmp_path)
    assert common.results_dir() == tmp_path
    assert common.results_path("ulysses", "NVIDIA H200", 4, None) == tmp_path / "ulysses-h200-ws4.md"
    assert common.results_path("ulysses", "NVIDIA H200", 4, tmp_path / "x.md") == tmp_path / "x.md"


def test_the_all_reduce_chart_is_built_from_the_results_not_the_markdown() -> None:
    s = allreduce.Settings(sizes=[16 << 10, 16 << 20], dtype="bf16", modes=["graph", "eager"], ops=1, replays=1,
                           eager_iters=1)  # fmt: skip
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


def test_a_bad_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "allreduce", "--dry-run", "--modes", "graph,warp"])
    assert exit_info.value.code == 2
    assert "unknown modes ['warp']" in capsys.readouterr().err


def test_the_checkout_scripts_run_the_packaged_benchmarks(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "ulysses.py"), "--dry-run", "--quick", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "ulysses-cpu-ws2.md").read_text().startswith(HEADINGS["ulysses"])
    assert f"written to {tmp_path / 'ulysses-cpu-ws2.md'}" in out.stdout
