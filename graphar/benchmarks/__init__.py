"""graphar's benchmarks, run as `python -m graphar bench allreduce|decode|ulysses` (graphar.benchmarks.cli).

    common     launch, CUDA-graph capture, timing, max over ranks, the report and where it goes
    plot       the PNG beside each table (matplotlib, an optional extra: graphar[plot])
    allreduce  all-reduce latency: NCCL, PyTorch symmetric memory and graphar, graphs and eager
    decode     one decode step of a tensor-parallel Llama-style model: Inductor + NCCL against graphar
    ulysses    the Ulysses exchanges: three all_to_all_singles against graphar's, over NCCL and IPC
"""
