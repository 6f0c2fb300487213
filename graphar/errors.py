"""The errors graphar's collectives raise; the all-reduce and the IPC all-to-all raise the same ones."""

from __future__ import annotations


class GrapharCommError(RuntimeError):
    """A communicator cannot serve the call: ranks disagreed, a set-up exchange failed, it was closed,
    or an earlier call timed out (then every later call raises `GrapharTimeoutError`, a subclass)."""


class GrapharTimeoutError(GrapharCommError):
    """A peer never reached a barrier of an all-reduce or all-to-all within GRAPHAR_TIMEOUT_S.

    The communicator stays unusable afterwards: its peers may be gone or out of step, so every
    later call on it raises this error again (catch `GrapharCommError` to handle both)."""
