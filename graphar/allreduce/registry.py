"""The registry: the one communicator that serves each process group, by the group's name.

`graphar.allreduce.set_up` registers a group's communicator once its set-up succeeded; a communicator's
`close` takes it out. A lookup is one dict read: every eager collective makes one (`set_up.communicator_or_set_up`).
It keeps what `Member` says of a communicator and imports none (graphar.allreduce.communicator imports it).
"""

from __future__ import annotations

from typing import Protocol


class Member(Protocol):
    """What the registry needs of a communicator (graphar.allreduce.communicator.Communicator)."""

    group_name: str

    def close(self) -> None: ...


_communicators: dict[str, Member] = {}


def communicator(group_name: str) -> Member | None:
    """The communicator that serves the group (a graphar.allreduce.communicator.Communicator), if one is set up."""
    return _communicators.get(group_name)


def register(comm: Member) -> None:
    """From now on `comm` serves its group."""
    _communicators[comm.group_name] = comm


def serves(comm: Member) -> bool:
    """Whether `comm` is the communicator registered for its group (a closed or replaced one is not)."""
    return _communicators.get(comm.group_name) is comm


def discard(comm: Member) -> None:
    """Take `comm` out, where it is the one registered for its group."""
    if serves(comm):
        del _communicators[comm.group_name]


def shutdown() -> None:
    """Close every communicator (each waits for its device first). Call it before
    `dist.destroy_process_group()`: otherwise a destroyed group's communicator holds its buffers until
    the group that torch next gives its name first collects (graphar.allreduce.set_up closes it there)."""
    errors = []
    for comm in list(_communicators.values()):
        try:
            comm.close()
        except Exception as e:  # noqa: BLE001  (close the rest, then report)
            errors.append(e)
    if errors:
        raise errors[0]
