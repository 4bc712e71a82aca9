"""The few vx exception types that cross module boundaries, and the exit code each means.

Runs in: every process. Only `vx.http` maps these to HTTP statuses; only the launcher and
`vx serve` map them to exit codes (`exit_code`, a `vx.exit_code.ExitCode` value). An error that
travels between processes carries its code in `WorkerDead` / `EngineDead`.
"""

from __future__ import annotations

from vx.exit_code import ExitCode


class EngineDeadError(RuntimeError):
    """The EngineCore or a Worker died; no request can make progress."""

    exit_code = ExitCode.ENGINE_DEAD


class EngineStartupError(RuntimeError):
    """A child process failed before it reported ready; `exit_code` says how it failed."""

    exit_code = ExitCode.STARTUP_FAILED

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code:
            self.exit_code = ExitCode(exit_code)


class ModelNotFoundError(EngineStartupError, FileNotFoundError):
    """The model is neither a local path nor a name vx can resolve."""

    exit_code = ExitCode.MODEL_NOT_FOUND


class AddressInUseError(EngineStartupError):
    """The HTTP host:port cannot be bound."""

    exit_code = ExitCode.ADDRESS_IN_USE


class KVCacheTooSmallError(EngineStartupError):
    """The memory given to the KV cache cannot hold one block (raised in a Worker)."""

    exit_code = ExitCode.KV_CACHE_TOO_SMALL
