"""The all-reduce's kernel choice (graphar.allreduce.policy) and the Python path that hands it to the CUDA
library and applies the library's plan, on the CPU.

The path runs against a fake communicator whose "device" is the CPU (-1), so that plain tensors are
eligible; it stands in for the library's plan (csrc/plan.cu, whose reasons tests/gpu assert) with a
row lookup in the table it was handed, and records the arguments that would reach the library.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import allreduce as allreduce_bench
import winners
from graphar import abi, ops, settings
from graphar.allreduce import graphs, policy, registry, set_up
from graphar.allreduce import kernels as ar

KB, MB = 1 << 10, 1 << 20
LIMITS = policy.Limits(max_bytes=8 * MB, push_one_shot=2 * MB)


def test_measured_rows_and_the_unmeasured_rule() -> None:
    h200 = policy.Policy(9, 2, LIMITS)
    assert {h200.pick(n, mode) for n in (16, 256 * KB, 8 * MB) for mode in policy.MODES} == {"1stage"}
    for ws, switch in ((4, 512 * KB), (6, 256 * KB), (8, 256 * KB)):
        p = policy.Policy(9, ws, LIMITS)
        assert p.pick(switch - 16, policy.EAGER) == "1stage" and p.pick(switch, policy.EAGER) == "2stage"
    assert policy.Policy(8, 2, LIMITS).pick(8 * MB, policy.GRAPH) == "1stage"


def test_tuned_rows_replace_the_shipped_ones_and_may_leave_a_size_to_nccl() -> None:
    rows = {policy.EAGER: ((64 * KB, "push-oneshot"), (policy.OPEN, None))}
    rows |= dict.fromkeys((policy.GRAPH, policy.GRAPHAR_GRAPH), ((policy.OPEN, "1stage"),))
    tuned = policy.Policy(9, 2, LIMITS).tuning(rows)
    assert tuned.pick(16 * KB, policy.EAGER) == "push-oneshot"
    assert tuned.pick(MB, policy.EAGER) is None and tuned.pick(MB, policy.GRAPH) == "1stage"
    assert tuned.forcing("2stage").pick(MB, policy.EAGER) == "2stage"  # forcing still wins
    assert tuned.forcing(None).pick(MB, policy.EAGER) is None  # and keeps the tuned rows
    assert tuned.shipped() == policy.table(9, 2)[0]


def test_rows_ascend_and_name_known_kernels() -> None:
    for modes in policy.TABLE.values():
        assert set(modes) == set(policy.MODES)
        for rows in modes.values():
            bounds = [bound for bound, _ in rows]
            assert bounds == sorted(bounds) and all(algo in abi.ALGO_CODES for _, algo in rows)


def test_forcing_another_kernel_turns_the_fused_norm_off() -> None:
    assert policy.Policy(9, 2, LIMITS).fused_norm_max > 0
    assert policy.Policy(9, 2, LIMITS, forced="push-oneshot").fused_norm_max > 0
    for other in ("1stage", "2stage", "push-twoshot"):
        assert policy.Policy(9, 2, LIMITS, forced=other).fused_norm_max == 0, other


def test_forced_kernel_within_its_limit_else_none() -> None:
    forced = policy.Policy(9, 8, LIMITS, forced="push-oneshot")
    assert forced.pick(2 * MB, policy.EAGER) == "push-oneshot"
    assert forced.pick(2 * MB + 16, policy.EAGER) is None  # NCCL serves it
    assert forced.pick(16, policy.EAGER, algo="2stage") == "2stage"  # a call's own choice wins
    with pytest.raises(ValueError, match="push-twoshot"):
        policy.Policy(9, 2, LIMITS, forced="oneshot")
    with pytest.raises(ValueError, match="push-twoshot"):
        forced.pick(16, policy.EAGER, algo="3stage")


def test_a_one_shot_row_past_the_one_shot_room_goes_two_shot(monkeypatch) -> None:
    rows = ((policy.OPEN, "push-oneshot"),)
    monkeypatch.setitem(policy.TABLE, (9, 8), dict.fromkeys(policy.MODES, rows))
    p = policy.Policy(9, 8, LIMITS)
    assert p.pick(2 * MB, policy.EAGER) == "push-oneshot" and p.pick(2 * MB + 16, policy.EAGER) == "push-twoshot"


def test_segments_are_the_picks(monkeypatch) -> None:
    """Every pick is a lookup in `segments`, the rows the CUDA library's plan looks calls up in."""
    rows = {
        policy.EAGER: ((64 * KB, "push-oneshot"), (MB, "1stage"), (policy.OPEN, "push-oneshot")),
        policy.GRAPH: ((policy.OPEN, "push-oneshot"),),
        policy.GRAPHAR_GRAPH: ((policy.OPEN, "1stage"),),
    }
    monkeypatch.setitem(policy.TABLE, (9, 2), rows)
    limits = policy.Limits(max_bytes=8 * MB, push_one_shot=512 * KB)
    for p in [policy.Policy(9, 2, limits)] + [policy.Policy(9, 2, limits, forced=a) for a in abi.ALGO_CODES]:
        for mode in policy.MODES:
            segments = p.segments(mode)
            assert [b for b, _ in segments] == sorted(b for b, _ in segments) and len(segments) <= abi.MAX_ROWS
            for n in range(16, 10 * MB, 16 * 1021):
                want = next((a for b, a in segments if n <= b), None)
                assert p.pick(n, mode) == want, (p.forced, mode, n)
    assert policy.Policy(9, 2, limits).segments(policy.EAGER) == (
        (64 * KB, "push-oneshot"),
        (MB, "1stage"),
        (policy.OPEN, "push-twoshot"),
    )  # past the one-shot's room
    assert policy.Policy(9, 2, limits).segments(policy.GRAPH) == (
        (512 * KB, "push-oneshot"),
        (policy.OPEN, "push-twoshot"),
    )
    assert policy.Policy(9, 2, limits, forced="push-oneshot").segments(policy.EAGER) == (
        (512 * KB, "push-oneshot"),
        (policy.OPEN, None),
    )


def test_forcing_makes_a_new_policy() -> None:
    table = policy.Policy(9, 2, LIMITS)
    forced = table.forcing("2stage")
    assert forced.forced == "2stage" and forced.fused_norm_max == 0 and table.forced is None
    assert forced.forcing(None).fused_norm_max == table.fused_norm_max
    with pytest.raises(AttributeError):
        table.forced = "1stage"  # a policy in use never changes under the library's copy of its rows


# ---- the eager path against a fake communicator ---------------------------------------------------


class _CpuComm:
    group_name, world_size, device, max_bytes = "g", 2, -1, MB
    usable = True
    one_shot_limit = MB

    def __init__(self) -> None:
        self.launched: list[dict[str, int]] = []
        self.tables: list[tuple[abi.Segments, int, bool]] = []  # the eager rows, fused norm, PDL of each table
        self._kernels = abi.Kernels()
        self.native = 0  # calls the C++ kernel served

    def set_kernels(self, kernels: abi.Kernels) -> None:
        self._kernels = kernels
        eager = tuple(
            (kernels.bounds[0][i], next((a for a, c in abi.ALGO_CODES.items() if c == kernels.algos[0][i]), None))
            for i in range(kernels.rows[0])
        )
        self.tables.append((eager, kernels.fused_norm_max, bool(kernels.pdl)))

    def plan(self, x: bytes, stream: int, how: int, algo: int) -> abi.Plan:
        _, nbytes, dtype, _, contiguous, _ = abi.TENSOR.unpack(x)
        if dtype < 0 or not contiguous or nbytes == 0 or nbytes % 16:
            return abi.Plan(
                0, 0, f"the input's {nbytes} bytes, dtype {dtype}, contiguous {contiguous}: no kernel reads it"
            )
        # The fixture allows no capture query: graphar.graph's calls are captured, the others not.
        path = abi.PATH_CAPTURED_COPY if how == abi.PLAN_GRAPHAR_GRAPH else abi.PATH_UNCAPTURED
        if algo:
            room = self.one_shot_limit if algo == abi.ALGO_CODES["push-oneshot"] else self.max_bytes
            return (
                abi.Plan(algo, path)
                if nbytes <= room
                else abi.Plan(0, 0, f"{nbytes} bytes is over the limits of the forced kernel")
            )
        mode = 2 if how == abi.PLAN_GRAPHAR_GRAPH else 0
        k = self._kernels
        row = next((i for i in range(k.rows[mode]) if nbytes <= k.bounds[mode][i]), None)
        chosen = 0 if row is None else k.algos[mode][row]
        return (
            abi.Plan(chosen, path)
            if chosen
            else abi.Plan(0, 0, f"the kernel table gives {nbytes} bytes to the collective")
        )

    def native_calls(self) -> int:
        return self.native

    def check(self) -> None:
        pass

    def launch_all_reduce(self, args: bytes) -> None:
        names = [name for name, _ in abi.ALL_REDUCE_ARGS_FIELDS]
        self.launched.append(dict(zip(names, abi.ALL_REDUCE_ARGS.unpack(args))))

    def pointer_info(self, ptr: int) -> tuple[int, bool]:
        return ptr, True


class _Capture:
    def __init__(self) -> None:
        self.recorded: list[Any] = []

    def record(self, owner: Any, call: Any) -> None:
        self.recorded.append(call)


@pytest.fixture
def cpu_all_reduce(monkeypatch) -> tuple[ar.AllReduce, _CpuComm]:
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: pytest.fail("asked about capture"))
    rows = {
        policy.EAGER: ((policy.OPEN, "push-oneshot"),),
        policy.GRAPH: ((policy.OPEN, "push-oneshot"),),
        policy.GRAPHAR_GRAPH: ((16 * KB, "push-oneshot"), (policy.OPEN, "1stage")),
    }
    monkeypatch.setitem(policy.TABLE, (9, 2), rows)
    comm = _CpuComm()
    return ar.AllReduce(comm, policy.Policy(9, 2, policy.Limits(MB, MB))), comm


def test_eager_call_passes_one_struct_and_allocates_only_the_output(cpu_all_reduce) -> None:
    allreduce, comm = cpu_all_reduce
    allreduce.pdl = True
    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    out = allreduce.try_all_reduce(x)
    assert out is not None and out.shape == x.shape and out.is_contiguous() and out.data_ptr() != x.data_ptr()
    assert comm.launched == [
        dict(
            input=x.data_ptr(),
            output=out.data_ptr(),
            nbytes=x.nbytes,
            stream=1234,
            dtype=abi.DTYPE_CODES[torch.bfloat16],
            algo=abi.ALGO_CODES["push-oneshot"],
            path=abi.PATH_UNCAPTURED,  # the plan asked the stream: the launch does not again
            slot=0,
        )
    ]
    assert allreduce.calls == 1 and allreduce.try_all_reduce(x.t()) is None  # strided: NCCL's


def test_the_op_copies_misaligned_inputs_and_says_once_why_it_falls_back(cpu_all_reduce, monkeypatch, caplog) -> None:
    allreduce, comm = cpu_all_reduce
    monkeypatch.setitem(registry._communicators, "g", types.SimpleNamespace(group_name="g", kernels=allreduce))
    monkeypatch.setattr(set_up, "_live", lambda group: True)  # the fake communicator's group is never destroyed
    monkeypatch.setattr(ops, "functional_all_reduce", lambda x, group_name: "collective")
    x = torch.randn(1025)[1:]  # contiguous, 4 bytes past an aligned start
    assert ops.all_reduce(x, "g") is not None and comm.launched[-1]["input"] % 16 == 0
    with caplog.at_level(logging.INFO, logger="graphar"):
        odd = [torch.randn(5), torch.randn(7), torch.arange(4)]  # 20 B, 28 B: not 16-byte packs; int64
        assert [ops.all_reduce(t, "g") for t in odd] == ["collective"] * 3
    said = [r.getMessage() for r in caplog.records if "runs on the collective" in r.getMessage()]
    assert len(said) == 2 and "20 bytes" in said[0] and "dtype -1" in said[1]  # 28 bytes: the same kind


def test_graphar_graph_records_only_the_v1_calls(cpu_all_reduce, monkeypatch) -> None:
    allreduce, comm = cpu_all_reduce
    capture = _Capture()
    monkeypatch.setattr(graphs, "current_capture", lambda: capture)
    small, large = torch.randn(16 * KB // 4), torch.randn(64 * KB // 4)
    allreduce.try_all_reduce(small)
    allreduce.try_all_reduce(large)
    assert [c["algo"] for c in comm.launched] == [abi.ALGO_CODES["push-oneshot"], abi.ALGO_CODES["1stage"]]
    assert [c["path"] for c in comm.launched] == [abi.PATH_CAPTURED_COPY, abi.PATH_ZERO_COPY]
    assert [c.tensor() for c in capture.recorded] == [large] and comm.launched[1]["slot"] == capture.recorded[0].slot


def test_slots_of_a_freed_graph_are_reused(cpu_all_reduce, monkeypatch) -> None:
    allreduce, comm = cpu_all_reduce
    allreduce.policy = policy.Policy(9, 2, policy.Limits(MB, MB), forced="1stage")  # v1: zero copy takes slots
    x = torch.randn(1024)

    def capture() -> _Capture:
        recording = _Capture()
        monkeypatch.setattr(graphs, "current_capture", lambda: recording)
        for _ in range(3):
            allreduce.try_all_reduce(x)
        return recording

    first = capture()
    assert [c.slot for c in first.recorded] == [1, 2, 3] and allreduce.slots_in_use == 3
    second = capture()
    graphs._release(graphs._slots(graphs.Capture()))  # a capture that recorded nothing hands back nothing
    allreduce.release_slots([c.slot for c in first.recorded])  # what the first graph's finalizer does
    assert allreduce.slots_in_use == 3
    third = capture()
    assert [c.slot for c in second.recorded] == [4, 5, 6] and [c.slot for c in third.recorded] == [1, 2, 3]
    assert allreduce.graph_calls == 9


def test_forced_kernel_that_cannot_take_the_size_says_so(cpu_all_reduce) -> None:
    allreduce, comm = cpu_all_reduce
    comm.one_shot_limit = 64 * KB
    allreduce.policy = policy.Policy(9, 8, policy.Limits(MB, 64 * KB), forced="push-oneshot")
    x = torch.randn(128 * KB // 4)
    assert allreduce.try_all_reduce(x) is None and not allreduce.eligible(x)
    with pytest.raises(ValueError, match="input not eligible: .* forced kernel"):
        allreduce.all_reduce(x)


def test_nothing_is_eligible_on_a_closed_communicator(cpu_all_reduce) -> None:
    allreduce, comm = cpu_all_reduce
    x = torch.randn(64)
    assert allreduce.eligible(x)
    comm.usable = False  # closed, or a kernel timed out: a call would raise
    assert not allreduce.eligible(x)


# ---- the table and the benchmark that measured it -------------------------------------------------

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "allreduce-h200-ws2.md"


def test_a_dry_run_report_reads_back(tmp_path: Path) -> None:
    s = allreduce_bench.Settings(
        sizes=[16 * KB, MB], dtype="bf16", modes=["graph", "eager"], ops=1, replays=1, eager_iters=1
    )
    results = {(m, n, c): 5.0 for m in s.modes for n in s.sizes for c in allreduce_bench.column_names(m)}
    results[("graph", MB, "graphar push-twoshot")] = 1.0
    text = "\n\n".join(f"## {heading}\n\n{table}" for heading, table in allreduce_bench.tables(results, s))
    read = winners.winners_from_report(text)
    assert (
        read["graph"] == [(16 * KB, "1stage"), (MB, "push-twoshot")] and read["graphar.graph"][1][1] == "push-twoshot"
    )


def test_policy_rows_from_winners() -> None:
    won = [(16 * KB, "push-oneshot"), (64 * KB, "push-oneshot"), (256 * KB, "1stage"), (MB, "push-twoshot")]
    assert winners.policy_rows(won) == ((64 * KB, "push-oneshot"), (256 * KB, "1stage"), (policy.OPEN, "push-twoshot"))


def test_h200_rows_are_the_committed_benchmark_s() -> None:
    measured = winners.winners_from_report(RESULTS.read_text())
    if measured is None:  # measured before the push kernels: 1stage won every size and mode
        assert policy.TABLE[(9, 2)] == dict.fromkeys(policy.MODES, ((policy.OPEN, "1stage"),))
        return
    assert set(measured) == set(policy.MODES)
    for mode, rows in measured.items():
        assert policy.TABLE[(9, 2)][mode] == winners.policy_rows(rows), mode


def test_policy_rows_tool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "policy_rows", RESULTS.parent.parent.parent / "tools" / "policy_rows.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    s = allreduce_bench.Settings(
        sizes=[16 * KB, MB], dtype="bf16", modes=["graph", "eager"], ops=1, replays=1, eager_iters=1
    )
    results = {(m, n, c): 5.0 for m in s.modes for n in s.sizes for c in allreduce_bench.column_names(m)}
    results.update({(m, MB, "graphar push-twoshot"): 1.0 for m in s.modes})
    report = tmp_path / "allreduce.md"
    report.write_text("\n\n".join(f"## {heading}\n\n{table}" for heading, table in allreduce_bench.tables(results, s)))
    assert tool.main([str(report), "9", "2"]) == 0
    printed = capsys.readouterr().out
    assert "'eager': ((16384, '1stage'), (OPEN, 'push-twoshot'),)," in printed and printed.startswith("    (9, 2): {")
    if winners.winners_from_report(RESULTS.read_text()) is None:
        assert tool.main([str(RESULTS), "9", "2"]) == 1


def test_the_library_gets_the_kernel_table_anew_on_every_change(cpu_all_reduce) -> None:
    allreduce, comm = cpu_all_reduce
    allreduce.pdl = False
    allreduce.pdl = True
    allreduce.policy = allreduce.policy.forcing("1stage")
    table = ((MB, "push-oneshot"), (policy.OPEN, "push-twoshot"))  # the one-shot's room is 1 MB
    fused = 512 * KB  # off once another kernel is forced
    assert comm.tables == [
        (table, fused, settings.PDL.get()),  # made: the library holds a table before any call
        (table, fused, False),
        (table, fused, True),
        (((MB, "1stage"), (policy.OPEN, None)), 0, True),
    ]
    comm.native = 5
    allreduce.try_all_reduce(torch.randn(64))
    assert allreduce.calls == 6  # both kernels of the op count
    with pytest.raises(ValueError, match="at most 32"):  # more rows than the library holds: refused, kept
        allreduce.policy = allreduce.policy.forcing(None).tuning(
            dict.fromkeys(policy.MODES, tuple((16 * (i + 1), "1stage") for i in range(abi.MAX_ROWS + 1)))
        )
    assert allreduce.policy.forced == "1stage" and len(comm.tables) == 4


def test_a_near_tie_keeps_the_previous_size_s_kernel() -> None:
    """Noise between near-equal kernels must not cut the policy into many rows (the CUDA library holds
    abi.MAX_ROWS of them per capture mode)."""
    s = allreduce_bench.Settings(
        sizes=[16 * KB << i for i in range(13)], dtype="bf16", modes=["eager"], ops=1, replays=1, eager_iters=1
    )
    results = {("eager", n, c): 9.0 for n in s.sizes for c in allreduce_bench.column_names("eager")}
    for i, n in enumerate(s.sizes):  # 1stage and the push one-shot trade places by 1%, size after size
        results[("eager", n, "graphar 1stage")] = 5.0 * (1.01 if i % 2 else 1.0)
        results[("eager", n, "graphar push-oneshot")] = 5.0 * (1.0 if i % 2 else 1.01)
    results[("eager", s.sizes[-1], "graphar push-twoshot")] = 4.0  # a clear win is taken
    eager = winners.fastest(results, s.sizes, s.modes, allreduce_bench.GRAPHAR_KERNELS)[policy.EAGER]
    assert winners.policy_rows(eager) == ((s.sizes[-2], "1stage"), (policy.OPEN, "push-twoshot"))


def test_every_table_fits_the_library() -> None:
    for major, world_size in policy.TABLE:
        for mode in policy.MODES:
            p = policy.Policy(major, world_size, policy.Limits(max_bytes=64 * MB, push_one_shot=16 * KB))
            assert len(p.segments(mode)) <= abi.MAX_ROWS, (major, world_size, mode)
