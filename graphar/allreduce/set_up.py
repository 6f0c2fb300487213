"""Which groups get an IPC communicator, and when: `init`, the set-up agreement, the set-up at a
group's first collective.

`init(group)` is collective over the group. It returns a `Communicator` only where the custom paths
are safe (one node, even world size <= 8, P2P confirmed by a real IPC store and load, NVLink between
every pair above 2 ranks); otherwise None on every rank, with the reason logged once. Where the
ranks differ in a setting every rank must share (`MUST_AGREE`), it raises GrapharCommError on every
rank. Every step whose outcome can differ between ranks ends in an exchange of verdicts
(`rendezvous`), so all ranks decide alike. `communicator_or_set_up` runs `init` for a group that never had it, at
its first eager collective.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from graphar import _cuda, settings
from graphar.allreduce import policy, registry, tuner
from graphar.allreduce.communicator import Communicator
from graphar.allreduce.kernels import block_limit
from graphar.allreduce.rendezvous import Rendezvous, agree, first_reason
from graphar.errors import GrapharCommError, GrapharCudaError, GrapharUnavailable
from graphar.triton_common import triton_available

logger = logging.getLogger("graphar")

_WORLD_SIZES = (2, 4, 6, 8)
# Set-ups started per (group name, global ranks): the generation in the keys of the set-up's exchange.
_generations: dict[tuple[str, tuple[int, ...]], int] = {}
_logged: set[str] = set()
# Groups whose set-up is settled: `init` ran for them (set up or not), or the automatic set-up does not
# apply. Kept with the group itself: torch reuses a name after destroy_process_group, and the new
# group must set up anew.
_settled: dict[str, dist.ProcessGroup] = {}
_captured_first: set[str] = set()  # groups whose first collective was captured, before any set-up


def _live(group: dist.ProcessGroup | None) -> bool:
    """Whether `group` is one torch has not destroyed (a destroyed group has left pg_map)."""
    return group is not None and group in dist.distributed_c10d._world.pg_map


def _close_destroyed(comm: Communicator) -> None:
    """Close a registered communicator set up for a group torch has destroyed since: torch gives the
    name to the next group it makes, whose ranks may differ (the C++ kernel stopped serving the name
    when torch unregistered it, graphar.allreduce.native_op)."""
    logger.warning(
        "graphar: closing the communicator of a destroyed group named %r: torch reuses group names "
        "(call graphar.shutdown() before destroy_process_group)",
        comm.group_name,
    )
    comm.close()


def communicator_or_set_up(group_name: str, device: torch.device) -> Communicator | None:
    """The communicator that serves a collective of the group on `device`. Where `init` never ran for
    the group, the group's first eager collective on a CUDA device runs it (GRAPHAR_AUTO_INIT, which
    every rank must set alike), so that backend="graphar" alone turns the custom paths on. Every rank
    makes the same call at the same point of the same program, so the ranks set up together, as
    `init` requires. A capture cannot exchange IPC handles: a first call inside one keeps NCCL, and
    the next eager call sets up. A communicator whose group torch destroyed is closed first, and the
    group that now has its name sets up anew. Cheap once settled: a few dict lookups."""
    comm = registry.communicator(group_name)
    if _live(_settled.get(group_name)):
        return comm  # settled: its communicator, or None where it has none
    if comm is not None:  # set up for a group torch has destroyed since
        if torch.cuda.is_current_stream_capturing():
            return None  # closing waits for the device, which a capture forbids: the next eager call closes it
        _close_destroyed(comm)
    if device.type != "cuda":
        return None
    group = dist.distributed_c10d._resolve_process_group(group_name)
    skip = _not_worth_setting_up(group)
    if skip is not None:
        _settled[group_name] = group
        logger.info("graphar: group %r is not set up at its first collective: %s", group_name, skip)
        return None
    if torch.cuda.is_current_stream_capturing():
        if group_name not in _captured_first:
            _captured_first.add(group_name)
            logger.warning(
                "graphar: group %r's first collective is inside a CUDA-graph capture, which cannot set it "
                "up: NCCL serves it in this graph; call graphar.init(group) (or run a step eagerly) "
                "before capturing",
                group_name,
            )
        return None
    logger.info("graphar: setting up group %r at its first collective (graphar.init was not called for it)", group_name)
    with torch.cuda.device(device):
        return init(group)


def sets_up_later(group_name: str, device: torch.device) -> bool:
    """Whether a collective of the group on `device` will set up its communicator when it first runs
    (a group not settled yet, or one that took a destroyed group's name)."""
    return (
        device.type == "cuda"
        and not _live(_settled.get(group_name))
        and _not_worth_setting_up(dist.distributed_c10d._resolve_process_group(group_name)) is None
    )


def _not_worth_setting_up(group: dist.ProcessGroup) -> str | None:
    """Why the automatic set-up leaves a group alone (None: it sets up): facts equal on every rank."""
    if not settings.AUTO_INIT.get():
        return "GRAPHAR_AUTO_INIT=0"
    if dist.get_world_size(group) == 1:
        return "one rank: nothing to exchange"
    return _backend_reason(group)  # gloo on CUDA tensors: its own choice


def _backend_reason(group: dist.ProcessGroup) -> str | None:
    """NCCL's groups set up; gloo's only where ranks share one GPU for testing (GRAPHAR_SHARE_GPU), which
    NCCL refuses."""
    backend = str(dist.get_backend(group))
    if "nccl" not in backend and not ("gloo" in backend and settings.SHARE_GPU.get()):
        return f"backend {backend!r} is not NCCL"
    return None


def init(
    group: dist.ProcessGroup | None = None, *, max_bytes: int | None = None, timeout_s: float | None = None
) -> Communicator | None:
    """Set up graphar's IPC communicator for `group` (default: the world) on the current CUDA device.

    Collective: every rank of the group calls it. Optional: a group without it sets up at its first
    eager collective (`communicator_or_set_up`); call it to choose the moment, the buffers' size or the timeout, or
    before a capture that would be the group's first collective. Returns None on every rank (and
    logs why, once) when the group cannot use it; raises GrapharCommError on every rank when the
    ranks differ in a setting they must share (`MUST_AGREE`). `max_bytes` (default
    GRAPHAR_MAX_ALLREDUCE_BYTES, 8 MiB) sizes the all-reduce's IPC buffers and bounds eligible calls;
    `timeout_s` (default GRAPHAR_TIMEOUT_S, 60; 0 = unbounded) bounds every spin wait on a peer; each
    is held to its variable's rule (SettingError).
    """
    if not dist.is_initialized():
        raise RuntimeError("graphar.init needs torch.distributed to be initialized")
    group = group if group is not None else dist.group.WORLD
    name = group.group_name
    comm = registry.communicator(name)
    if comm is not None and not _live(_settled.get(name)):
        _close_destroyed(comm)
        comm = None
    if comm is not None:
        asked = {"max_bytes": max_bytes, "timeout_s": timeout_s}
        differ = {k: v for k, v in asked.items() if v is not None and float(v) != float(getattr(comm, k))}
        if differ:  # set up already (by an earlier init or at the group's first collective)
            logger.warning(
                "graphar.init of group %r: its communicator is set up already (max_bytes=%d, timeout_s=%g), "
                "so %s are not applied; graphar.shutdown() first to set it up anew",
                name,
                comm.max_bytes,
                comm.timeout_s,
                differ,
            )
        return comm
    # Checked by the rules their variables' values meet (graphar.settings).
    max_bytes = settings.MAX_ALLREDUCE_BYTES.get() if max_bytes is None else settings.byte_limit(max_bytes, "max_bytes")
    timeout_s = settings.TIMEOUT_S.get() if timeout_s is None else settings.seconds(timeout_s, "timeout_s")
    _settled[name] = group
    reason = _uniform_reason(group)
    if reason is None and not torch.cuda.is_available():
        reason = "CUDA is not available"  # NCCL groups imply CUDA on every rank
    comm = None
    if reason is None:
        comm, reason = _set_up(group, name, max_bytes, timeout_s)
    if comm is None:
        _disabled(name, str(dist.get_backend(group)), reason or "unknown")
        return None
    try:
        _tune(comm, group)
    except BaseException:  # a peer gone mid-tuning (its exchange timed out), a kernel that failed: nothing leaks
        comm.close()
        raise
    registry.register(comm)
    comm.serve_native()
    return comm


def _tune(comm: Communicator, group: dist.ProcessGroup) -> None:
    """The kernel table measured on this group (graphar.allreduce.tuner), from the cache where a job before
    measured it; nothing when GRAPHAR_TUNE=0 or a kernel is forced. Collective: where a rank cannot
    say what the table depends on, every rank keeps the shipped table, and a warning says why."""
    kernels = comm.kernels.policy
    if not settings.TUNE.get() or kernels.forced is not None:
        return
    start, shipped = time.monotonic(), kernels.shipped()
    nccl = dist.get_backend(group) == "nccl"
    names = tuner.candidates(settings.DETERMINISTIC.get(), nccl)
    what = f"graphar tuner of group {comm.group_name!r}"
    try:
        local = {
            "gpu": torch.cuda.get_device_name(comm.device),
            "driver": _cuda.driver_version(),
            "bus": _cuda.pci_bus_id(comm.device),
            "build": _cuda.build_id(),
            "nccl": torch.cuda.nccl.version() if nccl else None,
        }
        error = None
    except Exception as e:  # noqa: BLE001  (any failure here means "do not tune", on every rank)
        local, error = {}, f"{type(e).__name__}: {e}"
    gathered = comm.all_gather((local, error), what)
    reason = first_reason([e for _, e in gathered])
    if reason is not None:
        logger.warning("graphar: %s did not run, the shipped table serves: %s", what, reason)
        return
    facts = {
        **{k: v for k, v in local.items() if k != "bus"},
        "gpus": [f["bus"] for f, _ in gathered],
        "torch": torch.__version__,
        "shipped": shipped,
        "pdl": comm.kernels.pdl,
        "blocks": block_limit(torch.cuda.get_device_capability(comm.device)[0]),
    }
    table = tuner.tuned_table(
        comm.rank,
        comm.all_gather,
        tuner.GpuTimer(comm.kernels, group),
        facts,
        names,
        shipped,
        comm.max_bytes,
        settings.TUNE_BUDGET_S.get(),
        _cuda._cache_root() / "tuned",
    )
    comm.kernels.policy = kernels.tuning(table.rows)
    comm.kernels.tuned = table
    logger.info(
        "graphar: all-reduce kernels of group %r %s in %.2f s (GRAPHAR_TUNE=0: the shipped table): %s\n%s",
        comm.group_name,
        "read from the tuner's cache" if table.source == "cache" else "measured",
        time.monotonic() - start,
        table.rows,
        "\n".join(table.describe()),
    )


def _disabled(group_name: str, backend: str, reason: str) -> None:
    if group_name not in _logged:
        _logged.add(group_name)
        logger.warning(
            "graphar: custom all-reduce off for group %r, its backend (%s) serves it: %s", group_name, backend, reason
        )


def _uniform_reason(group: dist.ProcessGroup) -> str | None:
    """Checks whose answer is the same on every rank, so no exchange is needed."""
    reason = _backend_reason(group)
    if reason is not None:
        return reason
    world_size = dist.get_world_size(group)
    if world_size not in _WORLD_SIZES:
        return f"world size {world_size} is not one of {_WORLD_SIZES}"
    return None


ARCH = "the GPU architecture (compute capability major)"
BUILD = "the CUDA library's build id"
TRITON = "whether Triton is installed"
TABLE = "the all-reduce kernel table (graphar.allreduce.policy)"
BLOCKS = "the block limit (GRAPHAR_BLOCK_LIMIT, else by GPU architecture)"
MAX_BYTES = "graphar.init(max_bytes=)"

# What every rank of a group must share, each with its cure: ranks that differ in one would launch
# unlike kernels or grids (barriers meet block by block) or make unlike collectives, and wait for
# each other until the timeout. In this order so that the first difference is the cause (the
# architecture sets the default block limit, GRAPHAR_MAX_ALLREDUCE_BYTES the default max_bytes).
MUST_AGREE: dict[str, str] = {
    # The kernel table and the default block limit are by architecture.
    ARCH: "put GPUs of one architecture in the group",
    # The kernels and how they meet their peers are the build's.
    BUILD: "run the same graphar version on every rank",
    # Without Triton a rank's Ulysses packs cannot place chunks in its peers' buffers: its exchanges differ.
    TRITON: "install Triton on every rank or on none",
    # Every call's kernel is picked from it.
    TABLE: "run the same graphar version on every rank",
    # The pass rewrites all-reduces up to it (the default of the max_all_reduce_bytes option).
    settings.MAX_ALLREDUCE_BYTES.name: "set GRAPHAR_MAX_ALLREDUCE_BYTES alike on every rank",
    # The kernels take calls up to it; larger ones run on NCCL.
    MAX_BYTES: "pass the same max_bytes to graphar.init on every rank",
    # It forces every call's kernel.
    settings.ALLREDUCE_ALGO.name: "set GRAPHAR_ALLREDUCE_ALGO alike on every rank",
    # Blocks per all-reduce launch: each meets its peers' block of the same index.
    BLOCKS: "set GRAPHAR_BLOCK_LIMIT alike on every rank",
    # Pulled and pushed exchanges meet their peers at different steps.
    settings.ALLTOALL_ALGO.name: "set GRAPHAR_ALLTOALL_ALGO alike on every rank",
    # Blocks of the all-to-all's copy, which meet their peers block by block.
    settings.PULL_BLOCKS.name: "set GRAPHAR_PULL_BLOCKS alike on every rank",
    # The tuner's steps are collectives: a rank that tunes alone, stops at another size or leaves NCCL in
    # where its peers do not would wait for them.
    settings.TUNE.name: "set GRAPHAR_TUNE alike on every rank",
    settings.TUNE_BUDGET_S.name: "set GRAPHAR_TUNE_BUDGET_S alike on every rank",
    settings.DETERMINISTIC.name: "set GRAPHAR_DETERMINISTIC alike on every rank",
    # A rank that does not set a group up at its first collective leaves its peers waiting in that set-up
    # (caught here at a set-up every rank reaches; else that set-up's exchange times out, naming the cause).
    settings.AUTO_INIT.name: "set GRAPHAR_AUTO_INIT alike on every rank",
    # A rank that refuses a shared GPU leaves its peers waiting in the set-up's exchange.
    settings.SHARE_GPU.name: "set GRAPHAR_SHARE_GPU alike on every rank",
}
# Ranks may differ in the others. GRAPHAR_PDL: the same kernel, which waits for the kernel before it
# on its own stream; only its start moves. GRAPHAR_NATIVE_OP: the C++ and Python kernels launch the
# same kernel with the same arguments. GRAPHAR_TIMEOUT_S, init(timeout_s=), GRAPHAR_EXCHANGE_TIMEOUT_S:
# each bounds this rank's own waits, and a rank that gives up tells no peer. GRAPHAR_CACHE_DIR,
# GRAPHAR_CUDA_ARCHS: where and for which GPUs the library is built; the build id stands for its
# kernels. GRAPHAR_SKIP_CUDA_BUILD: read at install only.


class Disagreement(NamedTuple):
    """A setting the ranks of a group differ in: its value on each rank, and how to make them agree."""

    setting: str
    values: tuple[Any, ...]  # in rank order
    cure: str

    def __str__(self) -> str:
        values = ", ".join(f"rank {r}: {'unset' if v is None else v}" for r, v in enumerate(self.values))
        return (
            f"the ranks differ in {self.setting} ({values}): {self.cure} (ranks that differ in it would wait "
            "for each other until the timeout)"
        )


def first_disagreement(launch: Sequence[Mapping[str, Any]]) -> Disagreement | None:
    """The first setting of `MUST_AGREE` whose value differs between ranks (`launch`: each rank's
    values, in rank order); None when they all agree. Every rank computes the same one."""
    for setting, cure in MUST_AGREE.items():
        values = tuple(rank[setting] for rank in launch)
        if any(v != values[0] for v in values[1:]):
            return Disagreement(setting, values, cure)
    return None


def _launch_settings(max_bytes: int, capability_major: int, world_size: int) -> dict[str, Any]:
    """This rank's value of every setting of `MUST_AGREE` but the build id (which needs the library);
    the communicator is made with these values, so it runs what the ranks compared."""
    return {
        ARCH: capability_major,
        TRITON: triton_available(),
        TABLE: policy.table(capability_major, world_size),
        settings.MAX_ALLREDUCE_BYTES.name: settings.MAX_ALLREDUCE_BYTES.get(),
        MAX_BYTES: max_bytes,
        settings.ALLREDUCE_ALGO.name: settings.ALLREDUCE_ALGO.get(),
        BLOCKS: block_limit(capability_major),
        **{
            s.name: s.get()
            for s in (
                settings.ALLTOALL_ALGO,
                settings.PULL_BLOCKS,
                settings.TUNE,
                settings.TUNE_BUDGET_S,
                settings.DETERMINISTIC,
                settings.AUTO_INIT,
                settings.SHARE_GPU,
            )
        },
    }


def _local_facts(device: int, launch: dict[str, Any]) -> dict[str, Any]:
    """This rank's facts for the set-up verdict; `launch` gets the build id where the library loads."""
    facts: dict[str, Any] = {"host": socket.gethostname(), "launch": launch, "bus": None, "error": None}
    try:
        facts["bus"] = _cuda.pci_bus_id(device)
        facts["launch"] = {**launch, BUILD: _cuda.build_id()}
    except (GrapharCudaError, GrapharUnavailable) as e:
        facts["error"] = str(e)
    return facts


def _shared_reason(facts: Sequence[dict[str, Any]]) -> str | None:
    """Why the group cannot use the custom paths, from every rank's facts (None: it can, so far);
    every rank computes the same one."""
    reason = first_reason([f["error"] for f in facts])
    if reason is not None:
        return reason
    if len({f["host"] for f in facts}) != 1:
        return f"the group spans several hosts: {sorted({f['host'] for f in facts})}"
    buses = [f["bus"] for f in facts]
    if len(set(buses)) != len(buses) and not settings.SHARE_GPU.get():
        return f"ranks share a GPU: {buses} (GRAPHAR_SHARE_GPU=1 lets them, for testing only)"
    return None


def _nvlink_reason(buses: Sequence[str], rank: int) -> str | None:
    try:
        # A peer on this rank's own GPU (GRAPHAR_SHARE_GPU) needs no link.
        missing = [
            r for r, bus in enumerate(buses) if bus != buses[rank] and not _cuda.nvlink_between(buses[rank], bus)
        ]
    except GrapharUnavailable as e:
        return f"cannot confirm NVLink ({e})"
    return f"no NVLink to ranks {missing}" if missing else None


def _set_up(
    group: dist.ProcessGroup, name: str, max_bytes: int, timeout_s: float
) -> tuple[Communicator | None, str | None]:
    """The set-up agreement: facts, then IPC handles, then open and store (probe 0), then load back
    (probe 1); every step's verdicts shared, so every rank returns alike, or raises alike where the
    ranks differ in a setting of `MUST_AGREE`."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.cuda.current_device()
    exchange = _exchange(group)
    # A rank that never comes: it did not call graphar.init, or set GRAPHAR_AUTO_INIT otherwise.
    what = f"graphar.init of group {name!r} (every rank of it must: graphar.init, or GRAPHAR_AUTO_INIT set alike)"

    capability_major = torch.cuda.get_device_capability(device)[0]
    launch = _launch_settings(max_bytes, capability_major, world_size)
    facts = exchange.all_gather(_local_facts(device, launch), what)
    reason = _shared_reason(facts)
    differ = first_disagreement([f["launch"] for f in facts]) if reason is None else None
    if differ is not None:  # a mistake to mend, not a machine to fall back on: refuse it
        raise GrapharCommError(f"graphar.init of group {name!r} refused: {differ}")
    if reason is None and world_size > 2:
        reason = first_reason(exchange.all_gather(_nvlink_reason([f["bus"] for f in facts], rank), what))
    if reason is not None:
        return None, reason

    comm: Communicator | None = None
    local: str | None = None
    handles = b""
    try:  # made with the settings' values the ranks compared (`launch`)
        comm = Communicator(
            group_name=name,
            rank=rank,
            world_size=world_size,
            device=device,
            max_bytes=launch[MAX_BYTES],
            timeout_s=timeout_s,
            blocks=launch[BLOCKS],
            forced_algo=launch[settings.ALLREDUCE_ALGO.name],
            capability_major=launch[ARCH],
            store=exchange,
        )
        handles = comm.ipc_handles()
    except (GrapharCudaError, GrapharUnavailable) as e:
        local = str(e)
    gathered = exchange.all_gather((handles, local), what)
    reason = first_reason([error for _, error in gathered])
    if reason is None:
        reason = agree(exchange, what, lambda: comm.open_peers([h for h, _ in gathered]) or comm.probe(0))
    if reason is None:  # every rank has stored into every peer: load it all back
        reason = agree(exchange, what, lambda: comm.probe(1))
    if reason is not None:
        if comm is not None:
            comm.close()
        return None, reason
    return comm, None


def _exchange(group: dist.ProcessGroup) -> Rendezvous:
    """The set-up's all-gathers: over the group's own store alone (torch prefixes it with the group's
    name, which no other live group has), never the world's, so a group sets up while other groups'
    ranks are busy elsewhere. The keys hold the group's ranks and a count of set-ups per name and
    ranks: torch gives a destroyed world's group names to the next world's groups, whose ranks may
    have set up other groups of that name (counted per name, they started at different counts and
    waited for keys the others never wrote), and a store can outlive the world (torchrun's agent
    store) with the old group's keys in it."""
    name, ranks = group.group_name, tuple(dist.get_process_group_ranks(group))
    generation = _generations.get((name, ranks), 0)
    _generations[(name, ranks)] = generation + 1
    store = dist.distributed_c10d._world.pg_map[group][1]
    prefix = f"graphar/allreduce/{name}/{'-'.join(map(str, ranks))}/{generation}"
    return Rendezvous(store, prefix, dist.get_rank(group), len(ranks), settings.EXCHANGE_TIMEOUT_S.get())
