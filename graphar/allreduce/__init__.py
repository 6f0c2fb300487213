"""The all-reduce: the group's IPC communicator (set-up, registry, rendezvous), the kernel table
(policy, tuner), the kernels' calls (kernels), graphar.graph's captures (graphs), the fused norm and
the op's C++ kernels (native_op)."""
