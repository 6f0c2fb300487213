"""The constants of the CUDA library's C ABI, mirrored once on the Python side.

csrc/graphar_cuda.h and csrc's barrier header define them; tests/test_abi_mirrors.py parses those
headers and holds these values equal to them, so a change on one side alone fails there.
"""

from __future__ import annotations

import ctypes
import struct
from typing import NamedTuple

import torch

from graphar import settings

# dtype codes (GRAPHAR_FLOAT32 ...) and algorithm codes (GRAPHAR_ONE_STAGE ...): the v1 pull kernels
# behind a barrier, and the barrier-free push kernels, which read their input in place.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ONE_STAGE, TWO_STAGE, PUSH_ONE_SHOT, PUSH_TWO_SHOT = "1stage", "2stage", "push-oneshot", "push-twoshot"
ALGO_CODES = {ONE_STAGE: 1, TWO_STAGE: 2, PUSH_ONE_SHOT: 3, PUSH_TWO_SHOT: 4}
PUSH_ALGOS = frozenset({PUSH_ONE_SHOT, PUSH_TWO_SHOT})
# Input paths of a launch (GRAPHAR_EAGER ...), PATH_ here so that they are not taken for the policy's
# capture modes (graphar.allreduce.policy.EAGER ...): copy-in, where the library asks the stream whether it
# is capturing; copy-in inside a foreign capture; zero copy through a graph slot; copy into the
# registered buffer then a graph slot; copy-in on a stream a plan found not capturing (graphar_comm_plan
# gives it: the stream is asked once). The all-to-all's copy takes the first two.
PATH_EAGER, PATH_CAPTURED_COPY, PATH_ZERO_COPY, PATH_STAGED, PATH_UNCAPTURED = 0, 1, 2, 3, 4
# Return codes besides CUDA's: bad arguments; a GRAPHAR_PLAN_EAGER_ONLY plan on a capturing stream; a call
# no kernel takes (graphar_comm_plan: the collective serves it, graphar_last_error says why).
EINVAL, CAPTURING, DECLINED = -1, -2, -3
# How graphar_comm_plan finds a call's capture mode (GRAPHAR_PLAN_EAGER_ONLY ...): eager only; the eager
# or the graph rows by the stream; graphar.graph's rows.
PLAN_EAGER_ONLY, PLAN_STREAM, PLAN_GRAPHAR_GRAPH = 0, 1, 2
# Flags of an all-to-all (GRAPHAR_A2A_PUSHED ...): the chunks were pushed into the receivers' buffers;
# this rank's pack already placed its own chunk in the output; the exchange's last copy (it gives the
# lease back).
A2A_PUSHED, A2A_OWN_PLACED, A2A_LAST = 1, 2, 4
# kMaxBlocks: one barrier slot per block.
MAX_BLOCKS = settings.MAX_BLOCKS
# The barrier a spin loop gave up in (enum Where), as error messages name it.
WHERE = {
    1: "all_reduce 1stage entry barrier",
    2: "all_reduce 1stage exit barrier",
    3: "all_reduce 2stage entry barrier",
    4: "all_reduce 2stage middle barrier",
    5: "all_to_all entry barrier",
    6: "all_to_all exit barrier",
    7: "all_reduce push-oneshot receive",
    8: "all_reduce push-twoshot scatter",
    9: "all_reduce push-twoshot gather",
    10: "all_reduce push entry",
    11: "all_to_all lease",
}


# Why a kernel gave up (enum Cause): a peer never arrived; it had given up on the barrier first; another
# kernel of the communicator ran at the same time on this rank; the peer was in a graph replay and this
# rank in an eager call, or the reverse; the peer was in another captured launch (graphs replayed in
# different orders on the ranks).
TIMED_OUT, PEER_GAVE_UP, CONCURRENT, OUT_OF_STEP, SWAPPED = 0, 1, 2, 3, 4


class ErrorRecord(ctypes.Structure):
    """struct ErrorRecord, in host-mapped memory the kernels write when they give up on a peer."""

    _fields_ = [(name, ctypes.c_uint32) for name in ("failed", "where", "peer", "block", "cause")]


def _packed(**names_by_code: str) -> tuple[tuple[tuple[str, str], ...], struct.Struct]:
    """A C argument struct from its fields' names per struct code, in the C order (Q: uint64_t, f: float,
    i: int32_t): its fields as (name, code) pairs, and its layout without padding ("="). A call packs
    its arguments with the layout's pack(...) and passes the bytes: cheaper than a ctypes Structure."""
    fields = tuple((name, code) for code, names in names_by_code.items() for name in names.split())
    return fields, struct.Struct("=" + "".join(code for _, code in fields))


# struct graphar_all_reduce_args, struct graphar_all_reduce_norm_args and struct graphar_tensor.
ALL_REDUCE_ARGS_FIELDS, ALL_REDUCE_ARGS = _packed(Q="input output nbytes stream", i="dtype algo path slot")
NORM_ARGS_FIELDS, NORM_ARGS = _packed(
    Q="input residual weight output residual_output nbytes row_bytes stream", f="eps", i="dtype weight_first reserved"
)
TENSOR_FIELDS, TENSOR = _packed(Q="data nbytes", i="dtype device contiguous reserved")
NO_TENSOR = TENSOR.pack(0, 0, -1, -1, 0, 0)


def describe(x: torch.Tensor | None) -> bytes:
    """struct graphar_tensor of `x` (None: NO_TENSOR), as the library's plans judge it."""
    if x is None:
        return NO_TENSOR
    return TENSOR.pack(x.data_ptr(), x.nbytes, DTYPE_CODES.get(x.dtype, -1), x.get_device(), x.is_contiguous(), 0)


class Plan(NamedTuple):
    """graphar_comm_plan's verdict: the kernel (an ALGO_CODES value) and the path to launch it on, or
    0 and 0 and why no kernel takes the call (`refusal`)."""

    algo: int
    path: int
    refusal: str | None = None


class AllToAllCopy(NamedTuple):
    """One stage's copy as graphar_comm_all_to_all takes it, but for the handle, output, lease and
    stream: from byte `src_offset` of the exchange buffers, rank i's chunk as `chunk_bytes / row_bytes`
    rows of `row_bytes`, row k at `i * dst_chunk_stride + k * dst_row_stride` of the output."""

    mode: int  # PATH_EAGER or PATH_CAPTURED_COPY
    src_offset: int
    chunk_bytes: int
    row_bytes: int
    dst_row_stride: int
    dst_chunk_stride: int
    flags: int  # A2A_*
    blocks: int


# A kernel table's rows per capture mode (GRAPHAR_MAX_ROWS): the tuner's size classes and the one-shot's
# split fit with room to spare.
MAX_ROWS = 32
# Rows as graphar.allreduce.policy makes them: (largest bytes, kernel or None: no kernel takes those sizes),
# ascending.
Segments = tuple[tuple[int, str | None], ...]


class Kernels(ctypes.Structure):
    """struct graphar_kernels: the communicator's kernel choice per capture mode (graphar.allreduce.policy's
    EAGER, GRAPH and GRAPHAR_GRAPH, in that order) and its launch settings."""

    _fields_ = [
        ("bounds", (ctypes.c_uint64 * MAX_ROWS) * 3),
        ("algos", (ctypes.c_int32 * MAX_ROWS) * 3),
        ("rows", ctypes.c_int32 * 3),
        ("pdl", ctypes.c_int32),
        ("fused_norm_max", ctypes.c_uint64),
    ]


class OpGroup(ctypes.Structure):
    """struct graphar_op_group: a group's communicator as the ops' C++ kernels call it."""

    _fields_ = [
        ("comm", ctypes.c_uint64),
        ("plan", ctypes.c_uint64),
        ("plan_norm", ctypes.c_uint64),
        ("all_reduce", ctypes.c_uint64),
        ("all_reduce_norm", ctypes.c_uint64),
        ("last_error", ctypes.c_uint64),
        ("device", ctypes.c_int32),
        ("rank", ctypes.c_int32),
    ]
