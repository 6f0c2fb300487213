"""Which all-reduce kernel serves a call: a table measured with `python bench/allreduce.py`.

The table is keyed by (compute capability major, world size) and capture mode, and lists rows
(largest size in bytes, kernel) in ascending order; the last row's kernel serves every larger size.
Capture modes:
- "eager": no capture;
- "graph": a capture graphar does not own (`torch.cuda.graph`, Inductor's cudagraph trees);
- "graphar.graph": graphar's own capture, where the v1 kernels read their inputs in place too.

Every input of a pick (architecture, world size, size, capture mode, the kernels' limits, the forced
kernel) is equal on every rank, so every rank picks alike.
"""

from __future__ import annotations

from typing import NamedTuple

from graphar.abi import ALGO_CODES, ONE_STAGE, PUSH_ONE_SHOT, PUSH_TWO_SHOT, TWO_STAGE, Segments

EAGER, GRAPH, GRAPHAR_GRAPH = "eager", "graph", "graphar.graph"
MODES = (EAGER, GRAPH, GRAPHAR_GRAPH)
KB = 1 << 10
OPEN = 1 << 62  # the last row's bound: every larger size

Rows = tuple[tuple[int, str | None], ...]  # as Segments (graphar.abi); None (tuned rows only): NCCL

# Measured on 2 x H200 (bench/results/allreduce-h200-ws2.md): 1stage is the fastest graphar kernel at
# every size to 64 MB in every mode. The push kernels enter a row once that benchmark has measured
# them on the GPUs the row is for; until then they run only when forced (GRAPHAR_ALLREDUCE_ALGO).
_V1_TWO_RANKS: Rows = ((OPEN, ONE_STAGE),)
TABLE: dict[tuple[int, int], dict[str, Rows]] = {
    (9, 2): dict.fromkeys(MODES, _V1_TWO_RANKS),
}
# Elsewhere (no measurement yet): 1stage reads ws x the message, so above 2 ranks it gives way to
# 2stage at sizes from the v1 design's measurements on 4 and 8 GPUs.
_UNMEASURED: dict[int, Rows] = {
    2: _V1_TWO_RANKS,
    4: ((512 * KB - 16, ONE_STAGE), (OPEN, TWO_STAGE)),
    6: ((256 * KB - 16, ONE_STAGE), (OPEN, TWO_STAGE)),
    8: ((256 * KB - 16, ONE_STAGE), (OPEN, TWO_STAGE)),
}


# The fused all-reduce + residual add + RMSNorm kernel (the push one-shot with a norm epilogue) serves
# messages up to this size; larger ones run the all-reduce and the norm apart. Not measured yet on
# any GPU: 512 KB covers decode (64 tokens of hidden 4096 in bf16), where a one-shot kernel is at home.
FUSED_NORM_MAX: dict[tuple[int, int], int] = {}
_FUSED_NORM_UNMEASURED = 512 * KB
# The largest message any communicator's fused norm takes: a larger one never fuses (passes/norm.py).
FUSED_NORM_CEILING = max([*FUSED_NORM_MAX.values(), _FUSED_NORM_UNMEASURED])


def fuses_norm(forced: str | None) -> bool:
    """Whether the fused norm kernel serves with this kernel forced (None: none). It is the push
    one-shot's, so forcing another kernel turns it off: the all-reduce and the norm then run apart,
    the all-reduce as forced."""
    return forced in (None, PUSH_ONE_SHOT)


class Limits(NamedTuple):
    """The largest message (bytes) each kernel takes on a communicator."""

    max_bytes: int  # every kernel
    push_one_shot: int


def rows(capability_major: int, world_size: int, mode: str) -> Rows:
    """The table's rows for a GPU architecture, world size and capture mode."""
    measured = TABLE.get((capability_major, world_size))
    return measured[mode] if measured is not None else _UNMEASURED[world_size]


def table(capability_major: int, world_size: int) -> tuple[dict[str, Rows], int]:
    """What a communicator of this GPU architecture and world size picks from: each capture mode's
    rows, and the fused norm's largest message before the kernels' limits."""
    key = (capability_major, world_size)
    modes = {mode: rows(capability_major, world_size, mode) for mode in MODES}
    return modes, FUSED_NORM_MAX.get(key, _FUSED_NORM_UNMEASURED)


class Policy:
    """The kernel per (size, capture mode) for one communicator, as rows the CUDA library picks every
    call's kernel from (graphar.allreduce.kernels.kernel_table). Immutable: `forcing(algo)` makes the
    policy with another forced kernel."""

    def __init__(
        self,
        capability_major: int,
        world_size: int,
        limits: Limits,
        forced: str | None = None,
        tuned: dict[str, Rows] | None = None,
    ) -> None:
        _check_algo(forced)
        self._key = (capability_major, world_size)
        self.limits = limits
        self._forced = forced
        self._rows, measured = table(capability_major, world_size)
        # Measured on this group (graphar.allreduce.tuner): its rows may name no kernel (None): NCCL serves.
        self.tuned_rows = tuned
        if tuned is not None:
            self._rows = tuned
        # Bytes of the all-reduce's input.
        self.fused_norm_max = min(measured, limits.push_one_shot) if fuses_norm(forced) else 0

    @property
    def forced(self) -> str | None:
        """The kernel every call runs on (GRAPHAR_ALLREDUCE_ALGO), or None: the table's."""
        return self._forced

    def forcing(self, algo: str | None) -> Policy:
        """This communicator's policy with `algo` forced (None: the table's picks)."""
        return Policy(*self._key, self.limits, algo, self.tuned_rows)

    def tuning(self, rows: dict[str, Rows]) -> Policy:
        """This communicator's policy with the rows the tuner measured."""
        return Policy(*self._key, self.limits, self._forced, rows)

    def shipped(self) -> dict[str, Rows]:
        """The shipped table's rows for this GPU architecture and world size, by capture mode."""
        return table(*self._key)[0]

    def segments(self, mode: str, algo: str | None = None) -> Segments:
        """The kernel by size in one capture mode, as rows (largest bytes, kernel or None: no kernel
        takes it) in ascending order: the CUDA library's plan looks every call up in these rows."""
        chosen = algo if algo is not None else self._forced
        _check_algo(chosen)
        if chosen is not None:
            return ((self._limit(chosen), chosen), (OPEN, None))
        out: list[tuple[int, str | None]] = []
        for bound, algo_ in self._rows[mode]:
            # A measured one-shot row past the one-shot's room (more ranks than the row assumed) goes two-shot.
            room = self.limits.push_one_shot
            if algo_ == PUSH_ONE_SHOT and bound > room:
                if not out or out[-1][0] < room:
                    out.append((room, PUSH_ONE_SHOT))
                algo_ = PUSH_TWO_SHOT
            out.append((bound, algo_))
        return tuple(out)

    def pick(self, nbytes: int, mode: str, algo: str | None = None) -> str | None:
        """The kernel the rows give a call of `nbytes` in one capture mode, as the library's plan looks it
        up for an input it can take (reports and the tuner ask; calls ask the library); None when no
        kernel takes the size."""
        return next((kernel for bound, kernel in self.segments(mode, algo) if nbytes <= bound), None)

    def _limit(self, algo: str) -> int:
        return self.limits.push_one_shot if algo == PUSH_ONE_SHOT else self.limits.max_bytes


def _check_algo(algo: str | None) -> None:
    if algo is not None and algo not in ALGO_CODES:
        raise ValueError(f"all-reduce algorithm must be one of {sorted(ALGO_CODES)}, got {algo!r}")
