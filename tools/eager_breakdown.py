"""Where the host time of one eager graphar all-reduce goes: each step of the call timed alone.

Run on two GPUs (NCCL) or, where one GPU is all there is, two processes sharing it (the set-up of
tools/one_gpu_check.py; host times are still real, kernel times are not). Usage, from the checkout:
    PYTHONPATH=. python tools/eager_breakdown.py [--bytes 16384] [--algo push-oneshot]
Prints one line per step: the median over loops of calls (2000, or 200 for the steps that launch a
kernel), in microseconds per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LOOPS = 7
# Steps that launch a kernel: fewer calls per loop, so that the launch queue never fills (on one shared
# GPU each kernel waits for the other process).
LAUNCHES = ("library call", "whole", "torch.ops", "(for comparison) x.add_")
OP_STEP = "torch.ops.graphar.all_reduce (the op as compiled graphs call it; its C++ kernel where built)"
WITHDRAWN_STEP = "torch.ops.graphar.all_reduce, C++ kernel withdrawn (through it to the Python kernel)"
UNFUSED_NORM_STEP = "torch.ops.graphar.all_reduce_add_rms_norm (unfused: the all-reduce, then "
# That step queues up to 9 launches a call (the all-reduce, its ordering event, and the norm: one Triton
# kernel, graphar.allreduce.rms_norm, or 7 torch ops where it cannot take the row): at 200 calls a loop
# the launch queue (about a thousand entries) would fill and the loop time the device, which on one
# shared GPU waits a time slice at every pull kernel's barrier (1644 us a call was read so with --algo
# 1stage and torch's 7 ops).
UNFUSED_NORM_CALLS = 20


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(LOOPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _steps(comm, nbytes: int, algo: str | None) -> dict[str, Callable[[], object]]:
    import graphar.ops
    from graphar import _cuda, abi
    from graphar.allreduce import graphs, policy, rms_norm

    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    norm = "one Triton norm kernel" if rms_norm.serves(x, None, None, (x.dtype, x.dtype)) else "7 norm kernels"
    out = torch.empty_like(x)
    ar = comm.kernels
    kernel = ar.policy.pick(nbytes, policy.EAGER, algo)
    stream = torch._C._cuda_getCurrentRawStream(comm.device)
    args = abi.ALL_REDUCE_ARGS.pack(
        x.data_ptr(),
        out.data_ptr(),
        nbytes,
        stream,
        abi.DTYPE_CODES[x.dtype],
        abi.ALGO_CODES[kernel],
        abi.PATH_EAGER,
        0,
    )
    described = abi.describe(x)
    forced = 0 if algo is None else abi.ALGO_CODES[algo]
    return {
        "comm.check()": comm.check,
        "graphs.current_capture()": graphs.current_capture,
        "abi.describe(x) (dtype, bytes, device, contiguity, address)": lambda: abi.describe(x),
        "library plan: eligibility, capture query, kernel pick": lambda: comm.plan(
            described, stream, abi.PLAN_STREAM, forced
        ),
        "torch.empty_like(x, memory_format=torch.contiguous_format) (the output)": lambda: torch.empty_like(
            x, memory_format=torch.contiguous_format
        ),
        "(for comparison) torch.empty_like(x)": lambda: torch.empty_like(x),
        "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(comm.device),
        "x.data_ptr() + out.data_ptr()": lambda: (x.data_ptr(), out.data_ptr()),
        "ALL_REDUCE_ARGS.pack(...) (one struct)": lambda: abi.ALL_REDUCE_ARGS.pack(
            x.data_ptr(), out.data_ptr(), nbytes, stream, 1, 2, 0, 0
        ),
        "library call: capture query, ordering event, launch": lambda: comm.launch_all_reduce(args),
        "whole AllReduce.try_all_reduce": lambda: ar.try_all_reduce(x, algo),
        "whole graphar.ops.all_reduce (the op's Python kernel, called directly)": lambda: graphar.ops.all_reduce(
            x, comm.group_name
        ),
        OP_STEP: lambda: torch.ops.graphar.all_reduce(x, comm.group_name),
        (
            "torch.ops.graphar.all_reduce_add_rms_norm (fused; one row, no residual or weight)"
            if nbytes <= min(ar.policy.fused_norm_max, _cuda.NORM_MAX_ROW_BYTES)
            else f"{UNFUSED_NORM_STEP}{norm})"
        ): lambda: torch.ops.graphar.all_reduce_add_rms_norm(x, None, None, 1e-6, comm.group_name),
        "(for comparison) x.add_(0), a plain torch op": lambda: x.add_(0),
        "(for comparison) x.add(0), a plain torch op with an output to allocate, as the all-reduce has": lambda: x.add(
            0
        ),
    }


def _time_steps(comm, nbytes: int, algo: str | None, rank: int) -> None:
    from graphar.allreduce import native_op

    steps = _steps(comm, nbytes, algo)
    for name, fn in [*steps.items(), (WITHDRAWN_STEP, steps[OP_STEP])]:
        dist.barrier()  # both ranks time the same step together: the kernels need their peer
        if name == WITHDRAWN_STEP:  # every call of the group handed to the Python kernel, for this step
            native_op.serve(comm.group_name, None)
        calls = UNFUSED_NORM_CALLS if name.startswith(UNFUSED_NORM_STEP) else 200 if name.startswith(LAUNCHES) else 2000
        us = _per_call_us(fn, calls)
        if name == WITHDRAWN_STEP:
            comm.serve_native()
        if rank == 0:
            print(f"{us:8.2f} us  {name}", flush=True)


def _worker(rank: int, world: int, nbytes: int, algo: str | None) -> None:
    import graphar

    one_gpu = torch.cuda.device_count() < world

    if one_gpu:
        from one_gpu_check import _init_relaxed

        comm = _init_relaxed()
    else:
        comm = graphar.init()
    if algo is not None:
        comm.kernels.policy = comm.kernels.policy.forcing(algo)
    try:
        _time_steps(comm, nbytes, algo, rank)
        torch.cuda.synchronize()
    finally:
        comm.close()


def main() -> int:
    from graphar import processes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=int, default=16 * 1024)
    p.add_argument("--algo", default=None, help="force a kernel (default: the policy's)")
    args = p.parse_args()
    print(
        f"eager all-reduce host time, {args.bytes} bytes bf16, kernel {args.algo or 'by policy'}; "
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}"
    )
    one_gpu = torch.cuda.device_count() < 2  # then both ranks share it, over gloo
    group = processes.gpu_group(one_gpu, collective_timeout_s=600)
    processes.start(_worker, 2, args.bytes, args.algo, group=group).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
