"""The C ABI's constants are written once in csrc and once in Python: this test holds the two equal.

It parses the headers (no build, no GPU), so editing either side alone fails here first.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

from graphar import _cuda, abi, settings
from graphar.allreduce import native_op

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def _text(name: str) -> str:
    return re.sub(r"//[^\n]*", "", (CSRC / name).read_text())


def _enum(text: str, prefix: str) -> dict[str, int]:
    """Every `NAME = value` in `text` whose name starts with `prefix`."""
    return {name: int(value) for name, value in re.findall(rf"\b({prefix}\w*)\s*=\s*(-?\d+)", text)}


def test_dtype_codes() -> None:
    codes = _enum(_text("graphar_cuda.h"), "GRAPHAR_")
    names = {torch.float32: "GRAPHAR_FLOAT32", torch.float16: "GRAPHAR_FLOAT16", torch.bfloat16: "GRAPHAR_BFLOAT16"}
    assert {dtype: codes[name] for dtype, name in names.items()} == abi.DTYPE_CODES


def test_algorithm_codes() -> None:
    codes = _enum(_text("graphar_cuda.h"), "GRAPHAR_")
    names = {
        abi.ONE_STAGE: "GRAPHAR_ONE_STAGE",
        abi.TWO_STAGE: "GRAPHAR_TWO_STAGE",
        abi.PUSH_ONE_SHOT: "GRAPHAR_PUSH_ONE_SHOT",
        abi.PUSH_TWO_SHOT: "GRAPHAR_PUSH_TWO_SHOT",
    }
    assert {algo: codes[name] for algo, name in names.items()} == abi.ALGO_CODES
    assert tuple(abi.ALGO_CODES) == settings.ALGOS  # GRAPHAR_ALLREDUCE_ALGO names every kernel


def test_all_to_all_flags() -> None:
    codes = _enum(_text("graphar_cuda.h"), "GRAPHAR_A2A_")
    assert codes == {
        "GRAPHAR_A2A_PUSHED": abi.A2A_PUSHED,
        "GRAPHAR_A2A_OWN_PLACED": abi.A2A_OWN_PLACED,
        "GRAPHAR_A2A_LAST": abi.A2A_LAST,
    }


def test_launch_paths() -> None:
    codes = _enum(_text("graphar_cuda.h"), "GRAPHAR_")
    python = {
        "GRAPHAR_EAGER": abi.PATH_EAGER,
        "GRAPHAR_CAPTURED_COPY": abi.PATH_CAPTURED_COPY,
        "GRAPHAR_ZERO_COPY": abi.PATH_ZERO_COPY,
        "GRAPHAR_STAGED": abi.PATH_STAGED,
        "GRAPHAR_UNCAPTURED": abi.PATH_UNCAPTURED,
    }
    assert {name: codes[name] for name in python} == python


def test_plan_modes_and_kernel_table() -> None:
    text = _text("graphar_cuda.h")
    assert _enum(text, "GRAPHAR_PLAN_") == {
        "GRAPHAR_PLAN_EAGER_ONLY": abi.PLAN_EAGER_ONLY,
        "GRAPHAR_PLAN_STREAM": abi.PLAN_STREAM,
        "GRAPHAR_PLAN_GRAPHAR_GRAPH": abi.PLAN_GRAPHAR_GRAPH,
    }
    rows = _enum(text, "GRAPHAR_ROWS_")
    assert [rows[f"GRAPHAR_ROWS_{m}"] for m in ("EAGER", "GRAPH", "GRAPHAR_GRAPH")] == [0, 1, 2]
    assert _enum(text, "GRAPHAR_ROW_MODES") == {"GRAPHAR_ROW_MODES": 3}
    (max_rows,) = re.findall(r"#define GRAPHAR_MAX_ROWS (\d+)", text)
    assert int(max_rows) == abi.MAX_ROWS
    body = re.search(r"typedef struct graphar_kernels \{([^}]*)\}", text).group(1)
    scalar = {"uint64_t": ctypes.c_uint64, "int32_t": ctypes.c_int32}
    declared = re.findall(r"(uint64_t|int32_t)\s+(\w+)((?:\[GRAPHAR_\w+\])*);", body)
    want = []
    for t, name, dims in declared:
        field = scalar[t]
        for dim in reversed(re.findall(r"\[(\w+)\]", dims)):
            field = field * {"GRAPHAR_ROW_MODES": 3, "GRAPHAR_MAX_ROWS": abi.MAX_ROWS}[dim]
        want.append((name, field))
    got = [(n, f) for n, f in abi.Kernels._fields_]
    assert [n for n, _ in got] == [n for n, _ in want]
    assert [ctypes.sizeof(f) for _, f in got] == [ctypes.sizeof(f) for _, f in want]


def test_return_codes() -> None:
    defines = dict(re.findall(r"#define (GRAPHAR_E?\w+) \((-\d+)\)", _text("graphar_cuda.h")))
    assert {name: int(v) for name, v in defines.items()} == {
        "GRAPHAR_EINVAL": abi.EINVAL,
        "GRAPHAR_CAPTURING": abi.CAPTURING,
        "GRAPHAR_DECLINED": abi.DECLINED,
    }


def test_barrier_where_codes_are_all_named() -> None:
    where = re.search(r"enum Where[^{]*\{([^}]*)\}", _text("signal.cuh")).group(1)
    assert sorted(int(v) for v in re.findall(r"\bk\w+\s*=\s*(\d+)", where)) == sorted(abi.WHERE)


def test_failure_causes() -> None:
    cause = re.search(r"enum Cause[^{]*\{([^}]*)\}", _text("signal.cuh")).group(1)
    assert dict(re.findall(r"\b(k\w+) = (\d+)", cause)) == {
        "kTimedOut": str(abi.TIMED_OUT),
        "kPeerGaveUp": str(abi.PEER_GAVE_UP),
        "kConcurrent": str(abi.CONCURRENT),
        "kOutOfStep": str(abi.OUT_OF_STEP),
        "kSwapped": str(abi.SWAPPED),
    }


def test_max_blocks() -> None:
    (value,) = re.findall(r"constexpr int kMaxBlocks = (\d+);", _text("signal.cuh"))
    assert int(value) == settings.MAX_BLOCKS == abi.MAX_BLOCKS


def test_error_record_layout() -> None:
    body = re.search(r"struct ErrorRecord \{([^}]*)\}", _text("signal.cuh")).group(1)
    fields = re.findall(r"(uint32_t)\s+(\w+);", body)
    assert [(name, ctypes.c_uint32) for _, name in fields] == list(abi.ErrorRecord._fields_)


@pytest.mark.parametrize(
    "name, fields, packed",
    [
        ("graphar_all_reduce_args", abi.ALL_REDUCE_ARGS_FIELDS, abi.ALL_REDUCE_ARGS),
        ("graphar_all_reduce_norm_args", abi.NORM_ARGS_FIELDS, abi.NORM_ARGS),
        ("graphar_tensor", abi.TENSOR_FIELDS, abi.TENSOR),
    ],
)
def test_argument_structs(name: str, fields: tuple, packed) -> None:
    body = re.search(rf"typedef struct {name} \{{([^}}]*)\}}", _text("graphar_cuda.h")).group(1)
    code = {"uint64_t": "Q", "int32_t": "i", "float": "f"}
    declared = [(field, code[t]) for t, field in re.findall(r"(uint64_t|int32_t|float)\s+(\w+);", body)]
    assert declared == list(fields)
    # Packed without padding ("="), as the C compiler lays it out: 8-byte fields first, then 4-byte ones.
    sizes = [8 if c == "Q" else 4 for _, c in fields]
    assert sizes == sorted(sizes, reverse=True) and packed.size == sum(sizes) and packed.size % 8 == 0


def test_norm_row_limit() -> None:
    text = _text("push_norm.cuh")
    (threads,) = re.findall(r"constexpr int kNormThreads = (\d+);", text)
    (per_thread,) = re.findall(r"constexpr int kNormPacksPerThread = (\d+);", text)
    assert int(threads) * int(per_thread) * 16 == _cuda.NORM_MAX_ROW_BYTES


def test_ipc_handle_size() -> None:
    (value,) = re.findall(r"#define GRAPHAR_IPC_HANDLE_BYTES (\d+)", _text("graphar_cuda.h"))
    assert int(value) == _cuda.IPC_HANDLE_BYTES


@pytest.mark.parametrize(
    "header, prototypes",
    [
        ("graphar_cuda.h", _cuda.PROTOTYPES),
        ("torch_ops/graphar_op.h", native_op.PROTOTYPES),
    ],
)
def test_prototypes_match_the_header(header: str, prototypes: dict) -> None:
    """Each export's argument count in a library's header equals the ctypes prototype's."""
    text = re.sub(r"\s+", " ", _text(header))
    declared = dict(re.findall(r"\b(graphar_\w+)\(([^)]*)\);", text))
    assert set(declared) == set(prototypes)
    for name, (_, argtypes) in prototypes.items():
        count = 0 if declared[name].strip() in ("", "void") else declared[name].count(",") + 1
        assert count == len(argtypes), name


# ---- the op library (csrc/torch_ops/graphar_op.h) -----------------------------------------------


def test_op_group_layout() -> None:
    body = re.search(r"typedef struct graphar_op_group \{([^}]*)\}", _text("torch_ops/graphar_op.h")).group(1)
    scalar = {"uint64_t": ctypes.c_uint64, "int32_t": ctypes.c_int32}
    assert [(n, f) for n, f in abi.OpGroup._fields_] == [
        (name, scalar[t]) for t, name in re.findall(r"(uint64_t|int32_t)\s+(\w+);", body)
    ]
