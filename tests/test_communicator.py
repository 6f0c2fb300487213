"""The IPC communicator's pure-Python logic, on the CPU: the all-reduce's eligibility,
the set-up agreement between ranks, the store exchange, and graph registration against a fake
communicator (the `CommCalls` seam)."""

from __future__ import annotations

import contextlib
import logging
import threading
import types
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from graphar import abi
from graphar.allreduce import communicator as cm
from graphar.allreduce import graphs, policy, registry, set_up
from graphar.allreduce import kernels as ar
from graphar.allreduce.rendezvous import Rendezvous
from graphar.errors import GrapharCommError, GrapharCudaError, SettingError

KB, MB = 1 << 10, 1 << 20


# ---- policy and eligibility ----------------------------------------------------------------


def test_block_limit_by_architecture_unless_set(monkeypatch) -> None:
    monkeypatch.delenv("GRAPHAR_BLOCK_LIMIT", raising=False)
    assert ar.block_limit(9) == 64 and ar.block_limit(8) == 36
    monkeypatch.setenv("GRAPHAR_BLOCK_LIMIT", "48")
    assert ar.block_limit(9) == 48 and ar.block_limit(8) == 48


# ---- agreement between ranks ---------------------------------------------------------------


def _facts(host="h", bus="0000:01:00.0", error=None):
    return {"host": host, "bus": bus, "launch": {}, "error": error}


def test_shared_verdict(monkeypatch) -> None:
    assert set_up._shared_reason([_facts(), _facts(bus="0000:02:00.0")]) is None
    assert "several hosts" in set_up._shared_reason([_facts(), _facts(host="other", bus="0000:02:00.0")])
    assert "share a GPU" in set_up._shared_reason([_facts(), _facts()])
    monkeypatch.setenv("GRAPHAR_SHARE_GPU", "1")  # the testing-only switch of the one-GPU tools
    assert set_up._shared_reason([_facts(), _facts()]) is None
    assert set_up._shared_reason([_facts(), _facts(error="no library")]) == "rank 1: no library"


def _launch_settings(capability_major: int = 9) -> dict[str, Any]:
    """This process's launch settings as `init` reads them on a rank of a pair of GPUs, build id included."""
    launch = set_up._launch_settings(set_up.settings.MAX_ALLREDUCE_BYTES.get(), capability_major, 2)
    return {**launch, set_up.BUILD: "0123abcd"}


def test_every_setting_that_must_agree_is_read() -> None:
    assert set(_launch_settings()) == set(set_up.MUST_AGREE)
    assert set_up.first_disagreement([_launch_settings()] * 4) is None


def test_the_first_difference_named_is_the_cause(monkeypatch) -> None:
    monkeypatch.delenv("GRAPHAR_BLOCK_LIMIT", raising=False)  # the block limits differ too: by architecture
    differ = set_up.first_disagreement([_launch_settings(9), _launch_settings(8)])
    assert differ.setting == set_up.ARCH and differ.values == (9, 8)


@pytest.mark.parametrize("setting", list(set_up.MUST_AGREE))
def test_a_setting_that_differs_on_one_rank_is_named_with_every_value(setting: str) -> None:
    same = _launch_settings()
    other = {**same, setting: "other"}
    differ = set_up.first_disagreement([same, other, same])
    assert differ == (setting, (same[setting], "other", same[setting]), set_up.MUST_AGREE[setting])
    shown = "unset" if same[setting] is None else same[setting]
    assert f"{setting} (rank 0: {shown}, rank 1: other, rank 2: {shown}): {set_up.MUST_AGREE[setting]}" in str(differ)


@pytest.mark.parametrize(
    "variable, value, cure",
    [
        ("GRAPHAR_MAX_ALLREDUCE_BYTES", "4096", "set GRAPHAR_MAX_ALLREDUCE_BYTES alike on every rank"),
        ("GRAPHAR_ALLREDUCE_ALGO", "2stage", "set GRAPHAR_ALLREDUCE_ALGO alike on every rank"),
        ("GRAPHAR_BLOCK_LIMIT", "48", "set GRAPHAR_BLOCK_LIMIT alike on every rank"),
        ("GRAPHAR_ALLTOALL_ALGO", "push", "set GRAPHAR_ALLTOALL_ALGO alike on every rank"),
        ("GRAPHAR_PULL_BLOCKS", "32", "set GRAPHAR_PULL_BLOCKS alike on every rank"),
        ("GRAPHAR_AUTO_INIT", "0", "set GRAPHAR_AUTO_INIT alike on every rank"),
        ("GRAPHAR_TUNE", "1", "set GRAPHAR_TUNE alike on every rank"),
        ("GRAPHAR_TUNE_BUDGET_S", "5", "set GRAPHAR_TUNE_BUDGET_S alike on every rank"),
        ("GRAPHAR_DETERMINISTIC", "0", "set GRAPHAR_DETERMINISTIC alike on every rank"),
        ("GRAPHAR_SHARE_GPU", "1", "set GRAPHAR_SHARE_GPU alike on every rank"),
    ],
)
def test_a_variable_set_on_one_rank_only_is_refused_with_its_cure(variable, value, cure, monkeypatch) -> None:
    for setting in set_up.settings.ALL:
        monkeypatch.delenv(setting.name, raising=False)
    rank0 = _launch_settings()
    monkeypatch.setenv(variable, value)
    differ = set_up.first_disagreement([rank0, _launch_settings()])
    assert differ is not None and differ.cure == cure
    assert differ.values[0] != differ.values[1]


@pytest.mark.parametrize("variable", ["GRAPHAR_PDL", "GRAPHAR_NATIVE_OP", "GRAPHAR_TIMEOUT_S", "GRAPHAR_CACHE_DIR"])
def test_a_variable_that_changes_nothing_peers_see_may_differ(variable, monkeypatch) -> None:
    rank0 = _launch_settings()
    monkeypatch.setenv(variable, "0" if variable != "GRAPHAR_CACHE_DIR" else "elsewhere")
    assert set_up.first_disagreement([rank0, _launch_settings()]) is None


def test_store_exchange_gathers_in_rank_order_and_times_out() -> None:
    store = dist.HashStore()
    results: dict[int, list] = {}

    def rank(r: int) -> None:
        exchange = Rendezvous(store, "t", r, 2, timeout_s=30)
        results[r] = [exchange.all_gather(("step", s, r), "test") for s in range(3)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = [[("step", s, 0), ("step", s, 1)] for s in range(3)]
    assert results == {0: expected, 1: expected}

    alone = Rendezvous(store, "alone", 0, 2, timeout_s=0.2)
    with pytest.raises(GrapharCommError, match="not every rank arrived"):
        alone.all_gather(None, "lonely step")


def test_init_on_a_group_that_cannot_use_it(caplog) -> None:
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with caplog.at_level(logging.WARNING, logger="graphar"):
            assert set_up.init() is None
            assert set_up.init() is None
        warnings = [r for r in caplog.records if "custom all-reduce off" in r.getMessage()]
        assert len(warnings) == 1 and "not NCCL" in warnings[0].getMessage()
        assert registry.communicator(dist.group.WORLD.group_name) is None
        # Held to the rules of GRAPHAR_MAX_ALLREDUCE_BYTES and GRAPHAR_TIMEOUT_S (graphar.settings).
        for bad, match in (
            ({"max_bytes": 24}, "max_bytes=24"),
            ({"max_bytes": 4096.0}, "max_bytes=4096.0"),
            ({"timeout_s": -1}, "timeout_s=-1"),
            ({"timeout_s": float("inf")}, "timeout_s=inf"),
        ):
            with pytest.raises(SettingError, match=match):
                set_up.init(**bad)
    finally:
        dist.destroy_process_group()


def test_init_of_a_set_up_group_says_which_arguments_it_cannot_apply(caplog, monkeypatch) -> None:
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        existing = types.SimpleNamespace(max_bytes=MB, timeout_s=60.0)
        monkeypatch.setitem(registry._communicators, dist.group.WORLD.group_name, existing)
        monkeypatch.setitem(set_up._settled, dist.group.WORLD.group_name, dist.group.WORLD)
        with caplog.at_level(logging.WARNING, logger="graphar"):
            assert set_up.init() is existing and set_up.init(max_bytes=MB, timeout_s=60) is existing
            assert not caplog.records
            assert set_up.init(max_bytes=4 * MB) is existing
        assert len(caplog.records) == 1 and "{'max_bytes': 4194304} are not applied" in caplog.records[0].getMessage()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("entry", ["init", "communicator_or_set_up"])
def test_the_communicator_of_a_destroyed_group_of_the_same_name_is_closed(entry, caplog, monkeypatch) -> None:
    """torch gives a destroyed group's name to its next group: `init` and the op kernels' `communicator_or_set_up`
    close the old communicator (its ranks may differ) and settle the new group afresh, except inside
    a capture, which cannot wait for the device: there NCCL serves, and the next eager call closes."""
    closed = []
    stale = types.SimpleNamespace(group_name=None, close=lambda: closed.append(True) or registry.discard(stale))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    call = {
        "init": set_up.init,
        "communicator_or_set_up": lambda: set_up.communicator_or_set_up(name, torch.device("cuda", 0)),
    }[entry]
    for generation in range(2):  # the second world reuses the first's group name
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        try:
            name = dist.group.WORLD.group_name
            if generation == 0:
                stale.group_name = name
                monkeypatch.setitem(registry._communicators, name, stale)
                monkeypatch.setitem(set_up._settled, name, dist.group.WORLD)
                assert call() is stale and not closed
            else:
                if entry == "communicator_or_set_up":
                    capturing[0] = True
                    assert call() is None and not closed, "closed inside a capture"
                    capturing[0] = False
                with caplog.at_level(logging.WARNING, logger="graphar"):
                    assert call() is None  # the fake backend: no new one
                assert closed == [True] and "destroyed group named" in caplog.records[0].getMessage()
                assert set_up._settled[name] is dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_set_up_keys_agree_on_a_group_name_another_world_used_for_other_ranks(monkeypatch) -> None:
    """Two ranks' histories, one process each turn: in a first world each sets up its own group of one,
    which torch names "1" on rank 0 and "2" on rank 1; the next world's group of both ranks is named "1"
    again. Both ranks must gather under one prefix (counted per name, rank 0 was at its second set-up
    of "1" and rank 1 at its first: each waited for keys the other never wrote), and not under the
    first world's "1" keys, which a store that outlives the world still holds."""
    prefixes = []
    for rank in (0, 1):
        monkeypatch.setattr(set_up, "_generations", {})  # a process of its own
        mine = []
        for world in range(2):
            dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
            try:
                group = [dist.new_group([r]) for r in range(2)][rank] if world == 0 else dist.new_group([0, 1])
                mine.append((group.group_name, set_up._exchange(group)._prefix))
            finally:
                dist.destroy_process_group()
        prefixes.append(mine)
    (first0, next0), (first1, next1) = prefixes
    assert (first0[0], first1[0], next0[0], next1[0]) == ("1", "2", "1", "1"), "the premise: torch reuses names"
    assert next0[1] == next1[1] and next0[1] != first0[1]


@pytest.fixture
def fresh_registry(monkeypatch) -> None:
    for name, empty in (("_settled", {}), ("_logged", set()), ("_captured_first", set())):
        monkeypatch.setattr(set_up, name, empty)


def test_the_automatic_set_up_leaves_alone_what_it_cannot_serve(fresh_registry, caplog, monkeypatch) -> None:
    """CPU tensors, a group that is not NCCL (here the fake backend), GRAPHAR_AUTO_INIT=0: no set-up,
    said once at INFO, settled (later calls cost two lookups)."""
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        name, group = dist.group.WORLD.group_name, dist.group.WORLD
        with caplog.at_level(logging.INFO, logger="graphar"):
            assert set_up.communicator_or_set_up(name, torch.device("cpu")) is None and name not in set_up._settled
            for _ in range(2):
                assert set_up.communicator_or_set_up(name, torch.device("cuda", 0)) is None
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "not set up at its first collective: backend 'fake' is not NCCL" in said[0]
        assert set_up._settled[name] is group
        monkeypatch.setenv("GRAPHAR_AUTO_INIT", "0")
        assert set_up._not_worth_setting_up(group) == "GRAPHAR_AUTO_INIT=0"
    finally:
        dist.destroy_process_group()


def test_first_eager_collective_on_cuda_runs_init_once_per_group(fresh_registry, caplog, monkeypatch) -> None:
    """Where it applies (NCCL, here faked), the first eager CUDA collective runs init, once; not
    inside a capture (warned once; the next eager call does); anew for a new group of the same name."""
    inits: list[dist.ProcessGroup] = []
    monkeypatch.setattr(set_up, "_not_worth_setting_up", lambda group: None)
    monkeypatch.setattr(
        set_up, "init", lambda group: inits.append(group) or set_up._settled.__setitem__(group.group_name, group)
    )
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = torch.device("cuda", 0)
    for generation in range(2):  # the second world reuses the first's group name
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        try:
            name = dist.group.WORLD.group_name
            with caplog.at_level(logging.WARNING, logger="graphar"):
                capturing[0] = generation == 0
                assert (
                    set_up.communicator_or_set_up(name, cuda) is None
                    and set_up.communicator_or_set_up(name, cuda) is None
                )
                capturing[0] = False
                for _ in range(3):
                    set_up.communicator_or_set_up(name, cuda)
            assert inits[generation:] == [dist.group.WORLD], generation
        finally:
            dist.destroy_process_group()
    captured = [r.getMessage() for r in caplog.records if "inside a CUDA-graph capture" in r.getMessage()]
    assert len(inits) == 2 and len(captured) == 1 and "graphar.init(group)" in captured[0]


def test_no_capture_outside_graph_and_batch_graphs_validation() -> None:
    assert graphs.current_capture() is None
    with pytest.raises(ValueError, match="positive"):
        graphs.BatchGraphs(lambda x: x, lambda b: (torch.ones(b),), [])
    with pytest.raises(ValueError, match="positive"):
        graphs.BatchGraphs(lambda x: x, lambda b: (torch.ones(b),), [0, 2])


# ---- graph registration: what ranks exchange and what reaches the C ABI ----------------------


class _FakeComm:
    """What the all-reduce asks of its communicator, for one emulated rank: the store is real,
    the library calls are recorded."""

    def __init__(self, rank: int, store: dist.Store) -> None:
        self.group_name, self.world_size, self.device, self.max_bytes = "g", 2, 0, MB
        self._store = Rendezvous(store, "graphs", rank, 2, timeout_s=30)
        self.broken: str | None = None
        self.registered: tuple | None = None
        self.forgotten: list[int] = []
        self.idle_closes = 0

    def check(self) -> None:
        if self.broken is not None:
            raise GrapharCommError(self.broken)

    def mark_broken(self, reason: str) -> None:
        self.broken = reason

    def set_kernels(self, kernels: abi.Kernels) -> None:
        pass

    def native_calls(self) -> int:
        return 0

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        return self._store.all_gather(obj, what)

    def ipc_handle(self, base: int) -> bytes:
        return base.to_bytes(8, "little") * 8  # a handle that names its allocation

    def fill_graph_slots(self, fill: ar.GraphSlots) -> None:
        slots, handles, offsets, staged, own_ptrs = fill
        self.registered = (list(slots), len(own_ptrs), handles, list(offsets), [int(s) for s in staged], list(own_ptrs))

    def forget_graph_slots(self, slots: Sequence[int]) -> None:
        self.forgotten += slots

    def close_unused_mappings(self) -> None:
        self.idle_closes += 1


def _graph_call(slot: int, x: torch.Tensor, base: int, staged: bool, signature: tuple[int, int, int]) -> ar.GraphCall:
    return ar.GraphCall(slot, weakref.ref(x), x.data_ptr(), base, staged, signature)


def _register_on_two_ranks(
    calls_per_rank, allreduces=None, lost_per_rank=((), ())
) -> tuple[list[_FakeComm], dict[int, BaseException]]:
    store = dist.HashStore()
    comms = [_FakeComm(r, store) for r in (0, 1)]
    allreduces = allreduces or [ar.AllReduce(comms[r], policy.Policy(9, 2, policy.Limits(MB, MB))) for r in (0, 1)]
    errors: dict[int, BaseException] = {}

    def run(r: int) -> None:
        allreduces[r].comm = comms[r]
        try:
            allreduces[r].register_graph(calls_per_rank[r], lost_per_rank[r])
        except BaseException as e:  # noqa: BLE001  (collected for the assertions)
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return comms, errors


def test_graph_registration_is_call_major_with_staged_entries() -> None:
    segments = [torch.empty(256) for _ in range(2)]  # stand-ins for the ranks' allocations
    calls = [
        [
            _graph_call(5, segments[0][16:80], segments[0].data_ptr(), False, (256, 2, 1)),
            _graph_call(6, segments[0][80:144], segments[0].data_ptr(), False, (256, 2, 2)),
        ],
        [
            _graph_call(9, segments[1][:64], segments[1].data_ptr(), True, (256, 2, 1)),
            _graph_call(3, segments[1][64:128], segments[1].data_ptr(), False, (256, 2, 2)),
        ],  # a recycled slot
    ]
    comms, errors = _register_on_two_ranks(calls)
    assert not errors
    slots, count, handles, offsets, staged, own = comms[0].registered
    assert (slots, count) == ([5, 6], 2)
    # [call 0: rank 0, rank 1][call 1: rank 0, rank 1]
    assert offsets == [64, 0, 320, 256] and staged == [0, 1, 0, 0]
    assert own == [c.ptr for c in calls[0]]
    handle = segments[0].data_ptr().to_bytes(8, "little") * 8
    assert handles == handle + bytes(64) + handle + segments[1].data_ptr().to_bytes(8, "little") * 8
    assert comms[1].registered[:2] == ([9, 3], 2)  # slot numbers are each rank's own


def test_a_dead_graphs_inputs_stay_until_every_rank_closed_its_mappings() -> None:
    """An exporter frees nothing a peer still maps: a dead graph's inputs are held until a later
    registration at which every rank says it let that graph go (after closing its unused mappings)."""
    x = torch.empty(64)
    call = _graph_call(1, x, x.data_ptr(), False, (256, 2, 1))
    allreduces = [
        ar.AllReduce(_FakeComm(r, dist.HashStore()), policy.Policy(9, 2, policy.Limits(MB, MB))) for r in (0, 1)
    ]
    comms, errors = _register_on_two_ranks([[call], [call]], allreduces)  # registration 0
    assert not errors
    allreduces[0].release_graph(0, [1], (x,))  # graph 0 died on rank 0 only
    assert comms[0].forgotten == [1] and allreduces[0].held_graphs == 1
    comms, errors = _register_on_two_ranks([[call], [call]], allreduces)  # registration 1: rank 1 still has it
    assert not errors and allreduces[0].held_graphs == 1 and all(c.idle_closes == 1 for c in comms)
    allreduces[1].release_graph(0, [1], (x,))
    _register_on_two_ranks([[call], [call]], allreduces)  # registration 2: both have let it go
    assert allreduces[0].held_graphs == 0 and allreduces[1].held_graphs == 0


def test_graph_registration_mismatch_is_an_error_on_every_rank() -> None:
    x = torch.empty(64)
    call, second = (_graph_call(slot, x, x.data_ptr(), False, (256, 2, 1)) for slot in (1, 2))
    comms, errors = _register_on_two_ranks([[call, second], [call]])
    assert set(errors) == {0, 1}
    assert all("different numbers" in str(e) for e in errors.values())
    assert all(c.registered is None for c in comms)
    with pytest.raises(GrapharCommError, match="registration"):
        comms[0].check()  # the communicator is unusable from then on

    other = _graph_call(1, x, x.data_ptr(), False, (512, 2, 1))
    _, errors = _register_on_two_ranks([[call], [other]])
    assert set(errors) == {0, 1} and all("disagree" in str(e) for e in errors.values())


def test_an_input_one_rank_could_not_keep_is_an_error_on_every_rank() -> None:
    """graphar.allreduce.graphs reports a call whose input was freed during the capture outside the graph's pool:
    no rank may register the graph (its peers would map reused memory), and every rank says which."""
    x = torch.empty(64)
    call = _graph_call(1, x, x.data_ptr(), False, (256, 2, 1))
    comms, errors = _register_on_two_ranks([[call], [call]], lost_per_rank=((), (0,)))
    assert set(errors) == {0, 1} and all("rank 1" in str(e) and "freed" in str(e) for e in errors.values())
    assert all(c.registered is None for c in comms)


def test_only_the_live_communicator_is_served_by_the_cpp_kernels(monkeypatch, caplog) -> None:
    """A closed, broken or replaced communicator never hands its (dangling) handle to the C++ kernels."""
    served: list[Any] = []
    refuse = [False]

    def serve(name: str, state: Any) -> None:
        if refuse[0] and state is not None:
            raise GrapharCudaError("graphar op library, group 'g': no process group of that name")
        served.append((name, state))

    monkeypatch.setattr(cm.native_op, "library", lambda: object())
    monkeypatch.setattr(cm.native_op, "serve", serve)
    monkeypatch.setattr(cm.native_op, "group_state", lambda **kwargs: "state")
    comm = cm.Communicator.__new__(cm.Communicator)  # no library: only the fields serve_native reads
    comm.group_name, comm._handle, comm._state, comm._lib = "g", 1, cm.State(cm.Life.OPEN), None
    comm._record = abi.ErrorRecord()
    comm.device, comm.rank = 0, 0
    comm.serve_native()  # not registered (another communicator, or none, holds the name)
    monkeypatch.setitem(registry._communicators, "g", comm)
    comm.serve_native()
    refuse[0] = True
    with caplog.at_level(logging.WARNING, logger="graphar"):
        comm.serve_native()  # the op library refuses: withdrawn, said, no error
    assert "run the Python kernel: graphar op library" in caplog.records[-1].getMessage()
    refuse[0] = False
    comm.mark_broken("out of step")
    comm.serve_native()
    assert served == [("g", "state"), ("g", None), ("g", None)]
