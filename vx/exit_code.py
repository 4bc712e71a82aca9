"""ExitCode: what `vx serve`'s exit status tells an operator (and its supervisor).

Runs in: the front process (the launcher and `vx serve`). The codes are a public interface:
README's "Operating vx" and `vx serve --help` list them, and the reliability tests hold each
failure to its code. Every failure the launcher can name exits with its own code after one
ERROR line; 1 is left for what it could not name (a bug), as Python itself uses it.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """`vx serve`'s exit status. Invariant: the values never change once released."""

    #: A clean stop: SIGTERM or SIGINT, in-flight requests drained (or failed at the budget).
    OK = 0
    #: An unexpected error in the front itself (a bug): its traceback is in the log.
    INTERNAL_ERROR = 1
    #: Bad flags or configuration, refused before anything started (argparse's code as well).
    BAD_CONFIG = 2
    #: An engine process (EngineCore or Worker) died, or hung past --step-timeout, while serving.
    ENGINE_DEAD = 3
    #: The engine failed to start (a child died or reported an error before it was ready).
    STARTUP_FAILED = 4
    #: The model could not be found or resolved (no such path, unknown alias).
    MODEL_NOT_FOUND = 5
    #: The HTTP address could not be bound (port in use, no permission).
    ADDRESS_IN_USE = 6
    #: The KV cache pool does not fit in the memory given (--kv-cache-memory, GPU memory).
    KV_CACHE_TOO_SMALL = 7

    @property
    def doc(self) -> str:
        return _DOCS[self]


_DOCS = {
    ExitCode.OK: "clean stop (SIGTERM/SIGINT, drained)",
    ExitCode.INTERNAL_ERROR: "unexpected error in the front (a bug; see the traceback)",
    ExitCode.BAD_CONFIG: "bad flags or configuration",
    ExitCode.ENGINE_DEAD: "an engine process died or hung past --step-timeout while serving",
    ExitCode.STARTUP_FAILED: "the engine failed to start",
    ExitCode.MODEL_NOT_FOUND: "the model could not be found",
    ExitCode.ADDRESS_IN_USE: "the HTTP address could not be bound (port in use)",
    ExitCode.KV_CACHE_TOO_SMALL: "no room for the KV cache in the memory given",
}


def exit_codes_help() -> str:
    """The table `vx serve --help` prints."""
    return "exit codes:\n" + "\n".join(f"  {c.value}  {c.doc}" for c in ExitCode)
