"""Test-only fault injection: make per-request code raise for requests carrying a magic seed.

Runs in: the EngineCore and Worker processes (imports nothing heavy). Off unless the environment
variable `VX_TEST_POISON` is set when the process starts, e.g.
``VX_TEST_POISON=engine:6661,worker:6662``: a request whose `SamplingParams.seed` is 6661 then
raises inside the EngineCore's per-request output update, and one whose seed is 6662 raises
inside the Worker's sampler. The reliability tests (tests/reliability, G9) use it to prove that
such a request fails alone, with finish reason "error", and that the engine keeps serving.

Invariant: with the variable unset, `poison_seed()` returns None and no code path changes. Set,
only what touches a poisoned request changes: a Worker step whose batch holds one leaves the fused
greedy step and the LM head's C argmax for the sampler, where that request raises (and fails
alone); every other step keeps them (`StepSampler.poisoned`), so a shared test server with the
variable set still serves its other requests on the default path.
"""

from __future__ import annotations

from vx import envs

__all__ = ["ENV", "PoisonError", "PoisonedStopSet", "poison_seed"]

ENV = "VX_TEST_POISON"


class PoisonError(RuntimeError):
    """The injected failure (a stand-in for a bug in per-request code)."""


def poison_seed(site: str) -> int | None:
    """The seed that poisons requests at `site` ("engine" or "worker"), or None (the default)."""
    spec = envs.VX_TEST_POISON
    for item in spec.split(","):
        name, _, value = item.strip().partition(":")
        if name == site and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


class PoisonedStopSet(frozenset):
    """A stop-token set whose membership test raises: it poisons the first token a request
    samples, in the EngineCore's per-request update, at no cost to other requests."""

    def __contains__(self, item: object) -> bool:
        raise PoisonError(f"{ENV}: injected failure in the per-request output update")
