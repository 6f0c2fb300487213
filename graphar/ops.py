"""graphar's custom ops, all six in one place: functional, with fakes, never returning an alias.

- `graphar::all_reduce(x, group_name)`: the sum over the group, through its communicator's custom
  kernels when there is one and the call is eligible, else the original functional collective. Eager
  calls on CUDA tensors go first to its C++ kernel where it is built (graphar.allreduce.native_op);
- `graphar::qkv_all_to_all(q, k, v, group_name)`: Ulysses sequence -> heads for Q, K and V in one
  packed exchange (`graphar.ulysses.exchanges.qkv_exchange` says what the result holds);
- `graphar::heads_to_seq_all_to_all(o, group_name)`: the output exchange, heads -> sequence;
- `graphar::packed_all_to_all_single(xs, group_name)`: N equal-split all_to_all_singles as one;
- `graphar::ulysses_attention(q, k, v, group_name, is_causal, scale, chunks, kernel)`: the Q/K/V
  exchange, attention (on the SDPA kernel named, if any) and output exchange as one pipeline over
  chunks of heads (`graphar.ulysses.overlap`);
- `graphar::all_reduce_add_rms_norm(x, residual, weight, eps, group_name)`: the sum, plus the residual,
  RMS-normalised; returns (normed, the sum plus the residual): one fused kernel up to the policy's
  size, else the all-reduce, then the add and the norm in one Triton kernel (graphar.allreduce.rms_norm).

Every op takes its group by name (as `_c10d_functional` does), returns new contiguous memory whatever
the inputs' strides, and has a fake that returns exactly the real op's sizes, strides and dtype:
Inductor compiles against the fakes and checks the real strides at run time. Every op is marked
side-effectful, so dead-code elimination keeps a collective a rank does not read. A communicator that
timed out raises instead of falling back: its peers may be gone.

The ops are defined with `torch.library.Library` and an explicit schema, not `torch.library.custom_op`:
a call through the dispatcher then costs about 2-3 us of host time instead of about 10 (custom_op adds a
Python autograd wrapper and alias checks to every call), which is most of a decode step's all-reduce
when it runs without CUDA graphs. The all-reduce and the fused norm go further: their Python kernels
are registered for CompositeExplicitAutograd, and C++ kernels for CUDA tensors (graphar.allreduce.native_op)
serve the plain eager calls without entering Python; the calls they decline go to two private ops,
`graphar::_all_reduce_python` and `graphar::_all_reduce_add_rms_norm_python`, which have the public
ops' Python kernels and nothing else (`_define_python_kernel`). The implementations never return an
alias of an input, so nothing is lost; none of the ops has a derivative (neither have the collectives
they replace).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from graphar.allreduce import rms_norm
from graphar.allreduce.set_up import communicator_or_set_up
from graphar.ulysses import exchanges, overlap, shapes

if TYPE_CHECKING:
    from graphar.allreduce.communicator import Communicator

c10d = torch.ops._c10d_functional


_lib = torch.library.Library("graphar", "DEF")
# The private ops (module docstring), in a library of their own: `_lib` records the public ones.
_python_kernels = torch.library.Library("graphar", "FRAGMENT")


def _define(
    schema: str, impl: Callable[..., Any], fake: Callable[..., Any], keys: tuple[str, ...] = ("CPU", "CUDA")
) -> None:
    """graphar::<schema>, run by `impl` for the dispatch `keys` and by `fake` on fake tensors; side-effectful.
    torch calls `fake` with the schema's arguments, positionally, a trailing one at its default left out."""
    name = schema[: schema.index("(")]
    _lib.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    for key in keys:
        _lib.impl(name, impl, key)
    torch.library.register_fake(f"graphar::{name}", fake, lib=_lib)
    torch.fx.node.has_side_effect(getattr(torch.ops.graphar, name).default)


def _define_python_kernel(schema: str, impl: Callable[..., Any]) -> None:
    """graphar::_<name>_python: graphar::<name>'s schema, its group name as UTF-8 bytes, run by `impl`
    alone. The op's C++ kernel (graphar.allreduce.native_op) hands it the calls it declines: built on torch's
    stable ABI, it can call an op only through the whole dispatcher, where graphar::<name> on CUDA
    tensors would come back to it. Bytes, not a str: torch 2.11 to 2.13 leak their copy of a str handed
    to that call (pytorch#191340), which a process with no communicator would pay on every call."""
    name, signature = schema[: schema.index("(")], schema[schema.index("(") :]
    at = [arg.strip() for arg in signature[1 : signature.index(")")].split(",")].index("str group_name")
    _python_kernels.define(f"_{name}_python{signature.replace('str group_name', 'int[] group_name')}")

    def kernel(*args: Any) -> Any:
        return impl(*args[:at], bytes(args[at]).decode(), *args[at + 1 :])

    _python_kernels.impl(f"_{name}_python", kernel, "CompositeExplicitAutograd")


def functional_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The collective the pass replaced: out-of-place sum through `_c10d_functional`."""
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum `x` over the group named `group_name`; returns a new contiguous tensor."""
    return _all_reduce_on(communicator_or_set_up(group_name, x.device), x, group_name)


def _all_reduce_on(comm: Communicator | None, x: torch.Tensor, group_name: str) -> torch.Tensor:
    """`all_reduce` on the group's communicator as looked up (None: the collective serves)."""
    if comm is None:
        return functional_all_reduce(x, group_name)
    out = comm.kernels.try_all_reduce(_flat(x))
    if out is None:
        comm.kernels.say_why_not()
        return functional_all_reduce(x, group_name)
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    """`x` as the kernels read it, a flat run of 16-byte packs: a transposed, sliced or misaligned
    input is summed from a fresh (contiguous, aligned) copy."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


# For every backend: the C++ kernel (graphar.allreduce.native_op), once installed, takes CUDA tensors before it
# and hands every call it does not serve itself to the same Python kernel through the private op. So
# for all_reduce_add_rms_norm below.
_ALL_REDUCE = "all_reduce(Tensor x, str group_name) -> Tensor"
_define(_ALL_REDUCE, all_reduce, lambda x, group_name: x.new_empty(x.shape), keys=("CompositeExplicitAutograd",))
_define_python_kernel(_ALL_REDUCE, all_reduce)


def qkv_all_to_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sequence -> heads for Q, K and V in one exchange: `[b, P*S, (hq + hk + hv)/P, d]`."""
    return exchanges.qkv_exchange((q, k, v), group_name)


# The Ulysses ops' fakes: their shapes and checks are the bodies' own (graphar.ulysses.shapes).
def _qkv_all_to_all_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str) -> torch.Tensor:
    return q.new_empty(shapes.qkv_shape((q, k, v), shapes.world_size(group_name), group_name))


_define(
    "qkv_all_to_all(Tensor q, Tensor k, Tensor v, str group_name) -> Tensor",
    qkv_all_to_all,
    _qkv_all_to_all_fake,
)


def heads_to_seq_all_to_all(o: torch.Tensor, group_name: str) -> torch.Tensor:
    """Heads -> sequence: `[b, P*S, h, d]` (all tokens, local heads) -> `[b, S, P*h, d]`."""
    return exchanges.output_exchange(o, group_name)


def _heads_to_seq_all_to_all_fake(o: torch.Tensor, group_name: str) -> torch.Tensor:
    return o.new_empty(shapes.output_shape(o, shapes.world_size(group_name), group_name))


_define(
    "heads_to_seq_all_to_all(Tensor o, str group_name) -> Tensor",
    heads_to_seq_all_to_all,
    _heads_to_seq_all_to_all_fake,
)


def packed_all_to_all_single(xs: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """`[all_to_all_single(x) for x in xs]` (equal splits) as one exchange."""
    return exchanges.packed_exchange(xs, group_name)


def _packed_all_to_all_single_fake(xs: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    out_shapes = shapes.packed_shapes(xs, shapes.world_size(group_name), group_name)
    return [x.new_empty(shape) for x, shape in zip(xs, out_shapes)]


_define(
    "packed_all_to_all_single(Tensor[] xs, str group_name) -> Tensor[]",
    packed_all_to_all_single,
    _packed_all_to_all_single_fake,
)


# The attention's options (is_causal, scale, chunks, kernel) do not change its result's shape.
def _ulysses_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, *_: Any
) -> torch.Tensor:
    shapes.qkv_shape((q, k, v), shapes.world_size(group_name), group_name)  # the exchange's checks
    return q.new_empty(q.shape)


_define(
    "ulysses_attention(Tensor q, Tensor k, Tensor v, str group_name, bool is_causal=False, float? scale=None, "
    "int chunks=2, str? kernel=None) -> Tensor",
    overlap.ulysses_attention,
    _ulysses_attention_fake,
)


def unfused_add_rms_norm(
    summed: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    weight_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm as the matched graph computes them, rounding for rounding: the norm
    in float32, then the cast back to the sum's dtype and the weight multiply, in HF LlamaRMSNorm's
    order (cast, then weight) or, with `weight_first`, in `F.rms_norm`'s (weight in float32, then
    cast). The reference of the fallback's norm (`add_rms_norm`), and the norm where its kernel cannot
    take the tensors."""
    h = summed if residual is None else summed + residual
    v = h.float()
    normed = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None and weight_first:
        normed = (normed * weight).to(h.dtype)
    else:
        normed = normed.to(h.dtype) if weight is None else weight * normed.to(h.dtype)
    return normed.contiguous(), h.contiguous()


def add_rms_norm_dtypes(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, weight_first: bool = False
) -> tuple[torch.dtype, torch.dtype]:
    """(normed, residual_out) dtypes, by type promotion as `unfused_add_rms_norm` computes them."""
    summed = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    plain = weight is None or weight_first  # the result is cast back to the sum's dtype last
    return (summed if plain else torch.promote_types(weight.dtype, summed)), summed


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    group_name: str,
    weight_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(sum of `x` over the group + `residual`) * `weight`; returns (normed, sum + residual).
    `residual` and `weight` may be None; `residual`, when given, has `x`'s shape, `weight` the last dim;
    `weight_first`: see `unfused_add_rms_norm`. One fused kernel where the communicator's takes the
    shapes (graphar.allreduce.kernels.AllReduce.try_all_reduce_norm), else the all-reduce then the norm."""
    # Flat and aligned, as the kernels read them: which kernel serves then depends on shapes alone,
    # equal on every rank, never on where a rank's tensors happen to start.
    residual, weight = (t if t is None else _flat(t) for t in (residual, weight))
    comm = communicator_or_set_up(group_name, x.device)
    if comm is not None:
        x = _flat(x)
        fused = comm.kernels.try_all_reduce_norm(x, residual, weight, eps, weight_first)
        if fused is not None:
            return fused
    summed = _all_reduce_on(comm, x, group_name)  # the communicator once: not looked up again
    return add_rms_norm(summed, rms_norm.Norm(residual, weight, eps, weight_first))


def add_rms_norm(summed: torch.Tensor, norm: rms_norm.Norm) -> tuple[torch.Tensor, torch.Tensor]:
    """`unfused_add_rms_norm`'s results in one Triton launch where the kernel takes the tensors
    (graphar.allreduce.rms_norm), else by torch's ops: the norm of the fused op's fallback, which then
    costs what Inductor's unfused graph costs, the all-reduce and one norm kernel."""
    dtypes = add_rms_norm_dtypes(summed, norm.residual, norm.weight, norm.weight_first)
    out = rms_norm.add_rms_norm(summed, norm, dtypes)
    return out if out is not None else unfused_add_rms_norm(summed, *norm)


# The output dtypes follow from the tensors and weight_first; the arguments' types are the schema's.
def _all_reduce_add_rms_norm_fake(x, residual, weight, eps, group_name, weight_first=False):
    normed, summed = add_rms_norm_dtypes(x, residual, weight, weight_first)
    return x.new_empty(x.shape, dtype=normed), x.new_empty(x.shape, dtype=summed)


_ALL_REDUCE_ADD_RMS_NORM = (
    "all_reduce_add_rms_norm(Tensor x, Tensor? residual, Tensor? weight, float eps, str group_name, "
    "bool weight_first=False) -> (Tensor, Tensor)"
)
_define(
    _ALL_REDUCE_ADD_RMS_NORM,
    all_reduce_add_rms_norm,
    _all_reduce_add_rms_norm_fake,
    keys=("CompositeExplicitAutograd",),
)
_define_python_kernel(_ALL_REDUCE_ADD_RMS_NORM, all_reduce_add_rms_norm)
