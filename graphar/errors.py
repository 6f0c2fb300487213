"""Every error graphar raises of its own, under one base: catch `GrapharError` for all of them.

    GrapharError
        SettingError            a bad option, argument or GRAPHAR_* variable (also a ValueError)
        GrapharUnavailable      the CUDA library cannot be had here (also a RuntimeError)
        GrapharCommError        a communicator cannot serve the call (also a RuntimeError)
            GrapharTimeoutError     a peer never arrived
            GrapharCudaError        a call into the CUDA library failed

This module imports nothing: setup.py loads it by path (through graphar.settings and graphar._cuda)
before the package can be imported.
"""

from __future__ import annotations


class GrapharError(Exception):
    """The base of every error graphar raises of its own."""


class SettingError(GrapharError, ValueError):
    """A GRAPHAR_* variable, a graphar option or an argument has a value graphar cannot use."""


class GrapharUnavailable(GrapharError, RuntimeError):
    """The CUDA library cannot be used here: no GPU, no nvcc, or the build failed."""


class GrapharCommError(GrapharError, RuntimeError):
    """A communicator cannot serve the call: ranks disagreed, a set-up exchange failed, it was closed,
    or an earlier call timed out (then every later call raises `GrapharTimeoutError`, a subclass)."""


class GrapharTimeoutError(GrapharCommError):
    """A peer never reached a barrier of an all-reduce or all-to-all within GRAPHAR_TIMEOUT_S.

    The communicator stays unusable afterwards: its peers may be gone or out of step, so every
    later call on it raises this error again (catch `GrapharCommError` to handle both)."""


class GrapharCudaError(GrapharCommError):
    """A call into the CUDA library failed; the message names the group and the op."""


class RanksFailed(GrapharError, RuntimeError):
    """Ranks of a launch (graphar.processes) raised or died (`failed`: rank -> its traceback);
    `killed`: the ranks still running when it ended, past its deadline (`hung`) or after another
    rank failed."""

    def __init__(self, failed: dict[int, str], killed: list[int], hung: bool, deadline_s: float | None) -> None:
        why = f"still running after {deadline_s:.0f} s" if hung else "still running when another rank failed"
        head = f"ranks {killed} {why}, killed\n" if killed else ""
        super().__init__(head + "\n".join(failed.values()))
        self.failed, self.killed, self.hung = failed, killed, hung and bool(killed)
