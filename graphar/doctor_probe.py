"""The doctor's probe: one process per GPU runs graphar.init, on every pair and on the whole group,
and writes down what it found (`python -m graphar doctor` reports it; graphar.doctor)."""

from __future__ import annotations

import itertools
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import graphar
from graphar import processes
from graphar.allreduce import native_op, policy
from graphar.allreduce.registry import communicator
from graphar.errors import RanksFailed
from graphar.ulysses import transport

KB, MB = 1 << 10, 1 << 20
PLAN_SIZES = (16 * KB, 64 * KB, 256 * KB, 512 * KB, 1 * MB, 2 * MB, 8 * MB, 16 * MB)
PROBE_BYTES = 64 * KB  # a pair probe's IPC buffers: the probe is the same at any size


class _Warnings(logging.Handler):
    """Collects the graphar logger's warnings: graphar.init says there why it turned a group off."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _init_verdict(group: dist.ProcessGroup, log: _Warnings, **kwargs: Any) -> tuple[str, list[str]]:
    """("ok", []) when graphar.init set the group up, else (its reason, the warnings it logged)."""
    before = len(log.messages)
    try:
        comm = graphar.init(group, **kwargs)
    except Exception as e:  # noqa: BLE001  (report whatever stopped it)
        return f"graphar.init raised {type(e).__name__}: {e}", []
    said = log.messages[before:]
    if comm is not None:
        return "ok", said
    # The warning reads "... its backend (nccl) serves it: <reason>": the reason alone makes the matrix's footnote.
    return (said[-1].split("serves it: ", 1)[-1] if said else "graphar.init returned None, logging no reason"), said


def _probe_pairs(rank: int, world_size: int, log: _Warnings) -> dict[str, str]:
    verdicts = {}
    for a, b in itertools.combinations(range(world_size), 2):
        group = dist.new_group([a, b])  # collective: every rank takes part, members probe
        if rank in (a, b):
            verdicts[f"{a}-{b}"], _ = _init_verdict(group, log, max_bytes=PROBE_BYTES)
            comm = communicator(group.group_name)
            if comm is not None:
                comm.close()
    return verdicts


def _worker(rank: int, world_size: int, out_dir: str) -> None:
    log = _Warnings()
    logging.getLogger("graphar").addHandler(log)
    try:
        facts: dict[str, Any] = {"pairs": _probe_pairs(rank, world_size, log)}
        facts["verdict"], facts["warnings"] = _init_verdict(dist.group.WORLD, log)
        comm = communicator(dist.group.WORLD.group_name)
        if comm is not None:
            facts["max_bytes"] = comm.max_bytes
            kernels = comm.kernels.policy
            facts["plan"] = {
                n: [kernels.pick(n, mode) for mode in policy.MODES] for n in PLAN_SIZES if n <= comm.max_bytes
            }
            facts["push"] = {"one_shot": kernels.limits.push_one_shot, "fused_norm": kernels.fused_norm_max}
            tuned = comm.kernels.tuned
            facts["tuned"] = None if tuned is None else {"source": tuned.source, "lines": tuned.describe()}
            facts["pdl"] = comm.kernels.pdl and torch.cuda.get_device_capability()[0] >= 9
            facts["alltoall"] = "push" if transport.of(comm).push else "pull"
            facts["native_op"] = native_op.library() is not None
            # Whether legacy IPC can share the caching allocator's memory: expandable segments say no.
            facts["shareable"] = comm.pointer_info(torch.empty(MB, device="cuda").data_ptr())[1]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(facts))
    finally:
        graphar.shutdown()
        dist.destroy_process_group()


def probe(world_size: int, timeout_s: float) -> tuple[list[dict[str, Any]], str | None]:
    """Every rank's facts, or why the probe failed."""
    with tempfile.TemporaryDirectory(prefix="graphar-doctor-") as tmp:
        try:
            processes.run(
                _worker,
                world_size,
                tmp,
                backend="nccl",
                device="rank",
                collective_timeout_s=timeout_s,
                deadline_s=timeout_s,
            )
        except RanksFailed as e:
            if e.hung:  # the ranks outlived the probe's bound
                return [], f"the probe did not finish within {timeout_s:.0f} s (--timeout)"
            return [], f"a probe process failed: {str(e).strip().splitlines()[-1]}"  # its last line says what
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)], None
