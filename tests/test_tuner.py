"""The tuner's decisions on the CPU: ranks with different timings agree, NCCL wins only where allowed and
faster, the budget stops every rank at one size, and the cache is hit, missed and shared by rank 0."""

from __future__ import annotations

import contextvars
import threading
from pathlib import Path
from typing import Any

import pytest

from graphar.allreduce import policy, tuner
from graphar.allreduce.tuner import NCCL

KB, MB = 1 << 10, 1 << 20
SHIPPED = dict.fromkeys(policy.MODES, ((512 * KB - 16, "1stage"), (policy.OPEN, "2stage")))


_rank: contextvars.ContextVar[int] = contextvars.ContextVar("rank", default=0)  # a thread's, where a test sets it


class Ranks:
    """All-gathers among `n` threads standing in for ranks."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._barrier = threading.Barrier(n)
        self._slots: list[Any] = [None] * n
        self.calls = 0

    def all_gather_for(self, rank: int):
        def all_gather(obj: Any, what: str) -> list[Any]:
            self._barrier.wait()
            self._slots[rank] = obj
            self._barrier.wait()
            out = list(self._slots)
            self._barrier.wait()
            if rank == 0:
                self.calls += 1
            return out

        return all_gather

    def run(self, fn) -> list[Any]:
        results: list[Any] = [None] * self.n
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.all_gather_for(rank))
            except BaseException as e:  # noqa: BLE001  (the test reports it)
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return results


def model(rank: int, noise: float = 0.0):
    """A timer: 1stage grows fastest with size, push one-shot is flat and cheap to 256 KB, NCCL wins at
    8 MB; `noise` (x rank) perturbs every time, differently per rank."""

    def timer(candidate: str, nbytes: int, mode: str) -> float | None:
        if candidate == "push-oneshot" and nbytes > 256 * KB:
            return None  # past its room
        base = {
            "1stage": 3 + nbytes / (64 * KB),
            "2stage": 6 + nbytes / (256 * KB),
            "push-oneshot": 2.5 + nbytes / (512 * KB),
            "push-twoshot": 5 + nbytes / (200 * KB),
            NCCL: 20 + nbytes / MB,
        }[candidate]
        return base * (1 + noise * ((rank * 7 + nbytes // KB) % 5 - 2) / 10)

    return timer


def test_ranks_with_different_timings_pick_one_table() -> None:
    ranks = Ranks(4)
    names = tuner.candidates(deterministic=False, nccl=True)
    tables = ranks.run(
        lambda rank, gather: tuner.tune(gather, model(rank, noise=0.3), names, SHIPPED, 8 * MB, budget_s=60)
    )
    assert all(t.rows == tables[0].rows for t in tables)
    eager = tables[0].rows["eager"]
    assert eager[0] == (256 * KB, "push-oneshot")  # flat and cheap while it fits
    assert eager[-1] == (policy.OPEN, None)  # NCCL, the fastest at the largest sizes measured
    assert all(k in (*tuner.GRAPHAR_CANDIDATES, None) for _, k in eager)


def test_a_candidate_s_time_is_its_slowest_rank_s() -> None:
    # Rank 1 is slow on push one-shot: the collective is as slow as rank 1.
    times = tuner.slowest([{"1stage": 5.0, "push-oneshot": 2.0}, {"1stage": 5.0, "push-oneshot": 9.0}])
    assert times == {"1stage": 5.0, "push-oneshot": 9.0} and tuner.winner(times) == "1stage"
    assert tuner.slowest([{"2stage": 1.0}, {"2stage": None}]) == {"2stage": None}
    assert tuner.winner({"1stage": 3.0, "2stage": 3.0}) == "1stage"  # ties to the earlier candidate
    assert tuner.winner({"1stage": None}) is None


def test_deterministic_keeps_nccl_out_even_where_it_is_faster() -> None:
    names = tuner.candidates(deterministic=True, nccl=True)
    assert NCCL not in names and names == tuner.GRAPHAR_CANDIDATES
    (table,) = Ranks(1).run(lambda rank, gather: tuner.tune(gather, model(0), names, SHIPPED, 8 * MB, budget_s=60))
    assert all(k is not None for mode in table.rows.values() for _, k in mode)


def test_the_budget_stops_every_rank_at_one_size_and_the_shipped_rows_take_the_rest() -> None:
    ranks = Ranks(2)
    clocks = [iter(range(0, 1000, 1)), iter(range(0, 1000, 3))]  # rank 1's clock runs three times faster

    def tune(rank, gather):
        return tuner.tune(
            gather, model(rank), tuner.GRAPHAR_CANDIDATES, SHIPPED, 8 * MB, budget_s=10, clock=clocks[rank].__next__
        )

    a, b = ranks.run(tune)
    assert a.times == b.times and a.rows == b.rows
    sizes = [n for n, _ in a.times["eager"]]
    assert sizes == list(tuner.SIZE_CLASSES[: len(sizes)]) and 2 <= len(sizes) < 8  # stopped by rank 1's clock
    assert 3 * len(sizes) <= 10  # rank 1's 3 s a size: stopped before the size that would overrun the budget
    last = sizes[-1]
    assert a.rows["eager"][-2:] == tuple((b_, k) for b_, k in SHIPPED["eager"] if b_ > last)[-2:]


def test_merged_rows_join_neighbours_and_end_open() -> None:
    measured = [(1 * KB, {"a": 1.0}), (2 * KB, {"a": 1.0}), (4 * KB, {"b": 1.0}), (8 * KB, {NCCL: 1.0})]
    shipped = ((4 * MB, "1stage"), (policy.OPEN, "2stage"))
    # Cut short by the budget: the shipped rows above the last size measured.
    cut = ((2 * KB, "a"), (4 * KB, "b"), (8 * KB, None), (4 * MB, "1stage"), (policy.OPEN, "2stage"))
    assert tuner.merged_rows(measured, shipped, complete=False) == cut
    # Every size to the largest the communicator takes: the last pick serves every larger one.
    assert tuner.merged_rows(measured, shipped, complete=True) == ((2 * KB, "a"), (4 * KB, "b"), (policy.OPEN, None))
    nothing_ran = [(1 * KB, {"a": None})]  # the shipped kernel of that size
    assert tuner.merged_rows(nothing_ran, shipped, complete=False) == shipped


FACTS = {"gpu": "NVIDIA H200", "driver": "580.1", "world_size": 2, "topology": "NV18", "build": "abc"}


def test_the_cache_is_hit_on_the_same_facts_and_missed_on_a_new_driver_or_build(tmp_path: Path) -> None:
    names = tuner.GRAPHAR_CANDIDATES
    counted = {"timer": 0}

    def timer(candidate: str, nbytes: int, mode: str) -> float | None:
        counted["timer"] += 1
        return model(0)(candidate, nbytes, mode)

    def run(facts):
        return Ranks(2).run(
            lambda rank, gather: tuner.tuned_table(rank, gather, timer, facts, names, SHIPPED, 1 * MB, 60, tmp_path)
        )

    first = run(FACTS)
    after_tuning = counted["timer"]
    assert after_tuning > 0 and all(t.source == "tuned" for t in first)
    again = run(FACTS)
    assert counted["timer"] == after_tuning and all(t.source == "cache" and t.rows == first[0].rows for t in again)
    for changed in ({**FACTS, "driver": "590.2"}, {**FACTS, "build": "def"}):
        counted["timer"] = 0
        assert all(t.source == "tuned" for t in run(changed)) and counted["timer"] > 0


def test_rank_0_s_cache_decides_for_every_rank(tmp_path: Path) -> None:
    # Only rank 0 reads the file; a rank that would have found none still takes rank 0's table.
    table = tuner.Table(dict.fromkeys(policy.MODES, ((policy.OPEN, "2stage"),)))
    facts = {**FACTS, "candidates": list(tuner.GRAPHAR_CANDIDATES), "max_bytes": MB}
    tuner.save(tmp_path, facts, table)

    def never(*args: Any) -> float:
        raise AssertionError("timed although rank 0 had a cached table")

    got = Ranks(2).run(
        lambda rank, gather: tuner.tuned_table(
            rank,
            gather,
            never,
            FACTS,
            tuner.GRAPHAR_CANDIDATES,
            SHIPPED,
            MB,
            60,
            tmp_path if rank == 0 else tmp_path / "x",
        )
    )
    assert all(t.rows == table.rows and t.source == "cache" for t in got)


def test_a_damaged_or_foreign_cache_file_is_not_read(tmp_path: Path) -> None:
    facts = {**FACTS, "candidates": ["1stage"], "max_bytes": MB}
    (tmp_path / f"{tuner.cache_key(facts)}.json").write_text("{not json")
    assert tuner.load(tmp_path, facts) is None
    tuner.save(tmp_path, facts, tuner.Table(dict.fromkeys(policy.MODES, ((policy.OPEN, "1stage"),))))
    assert tuner.load(tmp_path, facts) is not None
    assert tuner.load(tmp_path, {**facts, "gpu": "NVIDIA H100"}) is None


@pytest.mark.parametrize("nbytes", [1 * KB, 3 * MB])
def test_describe_names_the_pick_and_each_candidate(nbytes: int) -> None:
    table = tuner.Table(
        dict.fromkeys(policy.MODES, ((policy.OPEN, "1stage"),)),
        {"eager": [(nbytes, {"1stage": 4.0, "2stage": None, NCCL: 3.0})]},
    )
    (line,) = table.describe()
    assert line.startswith(f"eager {tuner._size(nbytes)}: nccl <- 1stage 4.0, 2stage n/a, nccl 3.0")


# ---- at set-up (graphar.allreduce.set_up._tune), on a stand-in communicator ------------------------------


class _AllReduce:
    def __init__(self, forced: str | None = None) -> None:
        self.policy = policy.Policy(9, 2, policy.Limits(max_bytes=MB, push_one_shot=MB), forced)
        self.pdl = True
        self.tuned = None


class _Comm:
    def __init__(self, rank: int, gather, forced: str | None = None) -> None:
        self.rank, self.device, self.max_bytes, self.group_name = rank, 0, MB, "0"
        self.kernels = _AllReduce(forced)
        self.all_gather = gather


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """What _tune asks of torch and the library, for a machine without GPUs; the tuner's cache in tmp_path."""
    from graphar import _cuda
    from graphar.allreduce import set_up

    monkeypatch.setenv("GRAPHAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(set_up.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(set_up.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(set_up.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(_cuda, "driver_version", lambda: "580.1")
    monkeypatch.setattr(_cuda, "build_id", lambda: "abc")
    monkeypatch.setattr(_cuda, "pci_bus_id", lambda device: "0000:19:00.0")
    timed: list[str] = []

    def timer(allreduce: Any, group: Any):
        def time_one(candidate: str, nbytes: int, mode: str) -> float | None:
            timed.append(candidate)
            return model(0)(candidate, nbytes, mode)

        return time_one

    monkeypatch.setattr(tuner, "GpuTimer", timer)
    return set_up, timed


def test_set_up_tunes_every_rank_alike_and_reads_the_cache_next_time(stand_in, monkeypatch) -> None:
    set_up, timed = stand_in
    monkeypatch.setenv("GRAPHAR_TUNE", "1")
    tuned = Ranks(2).run(lambda rank, gather: _tuned(set_up, rank, gather))
    rows = tuned[0].kernels.tuned.rows
    assert all(c.kernels.tuned.source == "tuned" and c.kernels.policy.tuned_rows == rows for c in tuned)
    assert timed and NCCL not in timed  # gloo: no NCCL candidate (and deterministic by default)
    timed.clear()
    cached = Ranks(2).run(lambda rank, gather: _tuned(set_up, rank, gather))
    assert not timed and all(c.kernels.tuned.source == "cache" and c.kernels.policy.tuned_rows == rows for c in cached)


def _tuned(set_up: Any, rank: int, gather: Any, forced: str | None = None) -> _Comm:
    comm = _Comm(rank, gather, forced)
    set_up._tune(comm, None)
    return comm


def test_set_up_keeps_the_shipped_table_when_off_forced_or_a_rank_cannot_say(stand_in, monkeypatch, caplog) -> None:
    set_up, timed = stand_in
    shipped = _AllReduce().policy.segments(policy.EAGER)
    monkeypatch.setenv("GRAPHAR_TUNE", "0")
    (off,) = Ranks(1).run(lambda rank, gather: _tuned(set_up, rank, gather))
    monkeypatch.setenv("GRAPHAR_TUNE", "1")
    (forced,) = Ranks(1).run(lambda rank, gather: _tuned(set_up, rank, gather, forced="2stage"))
    assert off.kernels.tuned is None and forced.kernels.tuned is None and not timed
    # Rank 1 cannot name its GPU: no rank times anything, every rank says why.
    from graphar import _cuda

    def bus(device: int) -> str:
        if _rank.get() == 1:
            raise _cuda.GrapharCudaError("no PCI bus id")
        return "0000:19:00.0"

    monkeypatch.setattr(_cuda, "pci_bus_id", bus)

    def rank_body(rank: int, gather: Any) -> _Comm:
        _rank.set(rank)
        return _tuned(set_up, rank, gather)

    with caplog.at_level("WARNING", logger="graphar"):
        comms = Ranks(2).run(rank_body)
    assert all(c.kernels.tuned is None and c.kernels.policy.segments(policy.EAGER) == shipped for c in comms)
    assert not timed and "rank 1: GrapharCudaError: no PCI bus id" in caplog.text
