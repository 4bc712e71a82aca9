"""The few vx exception types that cross module boundaries.

Runs in: every process. Only `vx.http` maps these to HTTP statuses.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore or a Worker died; no request can make progress."""


class EngineStartupError(RuntimeError):
    """A child process failed before it reported ready."""
