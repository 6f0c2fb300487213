"""graphar's all-reduce op: functional, with a fake implementation, never returning an alias.

`graphar::all_reduce` serves a group through its graphar communicator when there is one and the
call is eligible; otherwise it runs the original functional collective, so a rewritten graph is
correct on every backend and device. Either way the result is a new contiguous tensor, as
`_c10d_functional.all_reduce` returns and as the fake says, whatever the input's strides. A
communicator that timed out raises instead of falling back: its peers may be gone.
"""

from __future__ import annotations

import torch

from graphar.comm import allreduce
from graphar.comm import ulysses as _ulysses  # noqa: F401  (registers the all-to-all ops)

c10d = torch.ops._c10d_functional


def functional_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The collective the pass replaced: out-of-place sum through `_c10d_functional`."""
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


@torch.library.custom_op("graphar::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum `x` over the group named `group_name`; returns a new contiguous tensor."""
    comm = allreduce.communicator(group_name)
    # A transposed or sliced input is summed from a contiguous copy: the kernels read flat buffers.
    out = comm.try_all_reduce(x.contiguous()) if comm is not None else None
    return out if out is not None else functional_all_reduce(x, group_name)


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return x.new_empty(x.shape)


torch.fx.node.has_side_effect(torch.ops.graphar.all_reduce.default)
