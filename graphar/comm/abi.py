"""The constants of the CUDA library's C ABI, mirrored once on the Python side.

csrc/graphar_cuda.h and csrc's barrier header define them; tests/test_abi_mirrors.py parses those
headers and holds these values equal to them, so a change on one side alone fails there.
"""

from __future__ import annotations

import ctypes

import torch

from graphar import settings

# dtype codes (GRAPHAR_FLOAT32 ...) and algorithm codes (GRAPHAR_ONE_STAGE ...)
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ONE_STAGE, TWO_STAGE = "1stage", "2stage"
ALGO_CODES = {ONE_STAGE: 1, TWO_STAGE: 2}
# Launch paths (GRAPHAR_EAGER ...): copy-in eager, copy-in inside a foreign capture, zero copy
# through a graph slot, copy into the registered buffer then a graph slot.
EAGER, CAPTURED_COPY, ZERO_COPY, STAGED = 0, 1, 2, 3
# kMaxBlocks: one barrier slot per block.
MAX_BLOCKS = settings.MAX_BLOCKS
# The barrier a spin loop gave up in (enum Where), as error messages name it.
WHERE = {1: "all_reduce 1stage entry", 2: "all_reduce 1stage exit", 3: "all_reduce 2stage entry",
         4: "all_reduce 2stage middle", 5: "all_to_all entry", 6: "all_to_all exit"}  # fmt: skip


class ErrorRecord(ctypes.Structure):
    """struct ErrorRecord, in host-mapped memory the kernels write when a spin times out."""

    _fields_ = [("failed", ctypes.c_uint32), ("where", ctypes.c_uint32), ("peer", ctypes.c_uint32),
                ("block", ctypes.c_uint32)]  # fmt: skip
