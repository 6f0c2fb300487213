"""The constants of the CUDA library's C ABI, mirrored once on the Python side.

csrc/graphar_cuda.h and csrc's barrier header define them; tests/test_abi_mirrors.py parses those
headers and holds these values equal to them, so a change on one side alone fails there.
"""

from __future__ import annotations

import ctypes
import struct

import torch

from graphar import settings

# dtype codes (GRAPHAR_FLOAT32 ...) and algorithm codes (GRAPHAR_ONE_STAGE ...): the v1 pull kernels
# behind a barrier, and the barrier-free push kernels, which read their input in place.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ONE_STAGE, TWO_STAGE, PUSH_ONE_SHOT, PUSH_TWO_SHOT = "1stage", "2stage", "push-oneshot", "push-twoshot"
ALGO_CODES = {ONE_STAGE: 1, TWO_STAGE: 2, PUSH_ONE_SHOT: 3, PUSH_TWO_SHOT: 4}
PUSH_ALGOS = frozenset({PUSH_ONE_SHOT, PUSH_TWO_SHOT})
# Input paths of a launch (GRAPHAR_EAGER ...), PATH_ here so that they are not taken for the policy's
# capture modes (graphar.comm.policy.EAGER ...): copy-in, where the library asks the stream whether it
# is capturing; copy-in inside a foreign capture; zero copy through a graph slot; copy into the
# registered buffer then a graph slot; copy-in or no launch at all when the stream is capturing
# (graphar::all_reduce's C++ kernel, which hands captures to Python). The all-to-all's copy takes the
# first two.
PATH_EAGER, PATH_CAPTURED_COPY, PATH_ZERO_COPY, PATH_STAGED, PATH_EAGER_ONLY = 0, 1, 2, 3, 4
# Return codes besides CUDA's: bad arguments; a GRAPHAR_EAGER_ONLY call on a capturing stream.
EINVAL, CAPTURING = -1, -2
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


# struct graphar_all_reduce_args and struct graphar_all_reduce_norm_args.
ALL_REDUCE_ARGS_FIELDS, ALL_REDUCE_ARGS = _packed(Q="input output nbytes stream", i="dtype algo path slot pdl reserved")
NORM_ARGS_FIELDS, NORM_ARGS = _packed(
    Q="input residual weight output residual_output nbytes row_bytes stream", f="eps", i="dtype weight_first pdl"
)


# The op library's (csrc/torch_ops/graphar_op.h): the rows of a published eager kernel choice. The
# all-reduce benchmark times 13 sizes, so a table from it has at most 13 rows, plus the one-shot's split.
OP_MAX_ROWS = 16
# Such rows, as graphar.comm.policy makes them: (largest bytes, kernel or None: no kernel takes those
# sizes), ascending; struct graphar_op_group carries them as its bounds and algos.
Segments = tuple[tuple[int, str | None], ...]


class OpGroup(ctypes.Structure):
    """struct graphar_op_group: what the ops' C++ kernels need of a group's communicator."""

    _fields_ = [
        ("comm", ctypes.c_uint64),
        ("all_reduce", ctypes.c_uint64),
        ("last_error", ctypes.c_uint64),
        ("failed", ctypes.c_uint64),
        ("max_bytes", ctypes.c_uint64),
        ("all_reduce_norm", ctypes.c_uint64),
        ("fused_norm_max", ctypes.c_uint64),
        ("norm_max_row_bytes", ctypes.c_uint64),
        ("bounds", ctypes.c_uint64 * OP_MAX_ROWS),
        ("algos", ctypes.c_int32 * OP_MAX_ROWS),
        ("rows", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("pdl", ctypes.c_int32),
    ]
