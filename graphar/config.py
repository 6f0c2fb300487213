"""graphar's configuration: what the compiler pass rewrites and the limits it applies.

One frozen object, built from `torch.compile(..., backend="graphar", options={...})` or
`graphar.install(...)`, validated when it is built: a bad option fails there, naming the option, the
value and what is allowed. Everything in it that changes the rewritten graph is part of
`cache_key()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphar import settings
from graphar.errors import SettingError

# torch.compile's modes, for `options={"mode": ...}` (torch refuses mode= together with options=).
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# attention_chunks="auto": graphar.ulysses.overlap.auto_chunks picks the chunks per shape at run time.
AUTO = "auto"


def _group_names(groups: Any) -> tuple[str, ...]:
    """Group names from a group, a name, or an iterable of either (ProcessGroups do not pickle)."""
    if isinstance(groups, str) or hasattr(groups, "group_name"):
        groups = (groups,)
    if not isinstance(groups, Iterable):
        raise SettingError(f"option exclude_groups={groups!r}: expected process groups or group names")
    names = []
    for group in groups:
        name = group if isinstance(group, str) else getattr(group, "group_name", None)
        if not isinstance(name, str):
            raise SettingError(f"option exclude_groups: {group!r} is neither a process group nor a group name")
        names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class Config:
    # Rewrite eligible all-reduces into graphar::all_reduce.
    all_reduce: bool = True
    # Rewrite Q/K/V all_to_all_single triplets into one packed exchange.
    qkv_all_to_all: bool = True
    # Fuse all-reduce + residual add + RMSNorm into one op (a fused kernel up to the policy's size).
    # Off until the fused kernel is measured on 2 GPUs.
    fuse_norm: bool = False
    # Pipeline each Ulysses attention (exchange, attention, exchange) over up to this many chunks of
    # heads (graphar::ulysses_attention); 0 or 1: off; "auto": as many as the rule measured on one GPU
    # picks per shape (graphar.ulysses.overlap.auto_chunks; 1 where chunking would cost more than it can
    # hide). Off until measured on 2 GPUs.
    attention_chunks: int | str = 0
    # Largest all-reduce (bytes) the pass rewrites; larger ones stay on their collective.
    max_all_reduce_bytes: int = field(default_factory=settings.MAX_ALLREDUCE_BYTES.get)
    # Group names the pass must leave on their original collective (groups are turned into names).
    exclude_groups: tuple[str, ...] = ()
    # Inductor config patches passed through by the "graphar" backend.
    inductor: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("all_reduce", "qkv_all_to_all", "fuse_norm"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(f"option {name}={getattr(self, name)!r}: expected True or False")
        chunks = self.attention_chunks
        if chunks != AUTO and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0):
            raise SettingError(f"option attention_chunks={chunks!r}: expected an int >= 0 (0 or 1: off) or {AUTO!r}")
        limit = settings.byte_limit(self.max_all_reduce_bytes, "option max_all_reduce_bytes")
        object.__setattr__(self, "max_all_reduce_bytes", limit)
        object.__setattr__(self, "exclude_groups", _group_names(self.exclude_groups))

    @property
    def pipelines_attention(self) -> bool:
        """Whether the pass rewrites Ulysses attentions into graphar::ulysses_attention."""
        return self.attention_chunks == AUTO or self.attention_chunks > 1

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> Config:
        """Split `torch.compile` options into graphar's fields and Inductor's patches (checked to exist)."""
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(cls)} - {"inductor"}
        ours = {k: options.pop(k) for k in list(options) if k in names}
        inductor = dict(options.pop("inductor", {}) or {})
        inductor.update(options)
        _check_inductor_keys(inductor, names)
        return cls(**ours, inductor=tuple(sorted(inductor.items())))

    def cache_key(self) -> str:
        return repr(dataclasses.astuple(self))


def _check_inductor_keys(patches: Mapping[str, Any], ours: set[str]) -> None:
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(k for k in patches if k not in known)
    if unknown:
        raise SettingError(
            f"options {unknown} are neither graphar's ({', '.join(sorted(ours | {'mode'}))}) nor Inductor "
            "config names (torch._inductor.config)"
        )
