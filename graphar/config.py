"""graphar's configuration: what the compiler pass rewrites and the limits it applies.

One frozen object, built from `torch.compile(..., options={...})` or `graphar.install(...)`.
Everything in it that changes the rewritten graph is part of `cache_key()`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

MB = 1 << 20


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


@dataclass(frozen=True)
class Config:
    # Rewrite eligible all-reduces into graphar::all_reduce.
    all_reduce: bool = True
    # Rewrite Q/K/V all_to_all_single triplets into one packed exchange.
    qkv_all_to_all: bool = True
    # Largest all-reduce (bytes) the pass rewrites; also the size of the IPC buffers.
    max_all_reduce_bytes: int = field(default_factory=lambda: _env_int("GRAPHAR_MAX_ALLREDUCE_BYTES", 8 * MB))
    # Group names the pass must leave on their original collective.
    exclude_groups: tuple[str, ...] = ()
    # Inductor config patches passed through by the "graphar" backend.
    inductor: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "Config":
        """Split `torch.compile` options into graphar's fields and Inductor's patches."""
        options = dict(options or {})
        names = {f.name for f in dataclasses.fields(cls)} - {"inductor"}
        ours = {k: options.pop(k) for k in list(options) if k in names}
        if "exclude_groups" in ours:
            ours["exclude_groups"] = tuple(ours["exclude_groups"])
        inductor = dict(options.pop("inductor", {}) or {})
        inductor.update(options)
        return cls(**ours, inductor=tuple(sorted(inductor.items())))

    def cache_key(self) -> str:
        return repr(dataclasses.astuple(self))
