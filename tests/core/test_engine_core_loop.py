"""The EngineCore's loop with async scheduling (`vx.core.engine_core.EngineCore.step`): step
n+1 is scheduled while step n runs, except behind a step that carries prefill tokens, so that
a request arriving during such a (long) step joins the very next one.

Runs in: the test process, with in-memory stand-ins for the rings and the WorkerGroup (the
real scheduler, and `FakeWorker` from the helpers for the model).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable

import anyio

from vx.core.engine_core import EngineCore
from vx.messages import ModelRunnerOutput, SchedulerOutput

from .helpers import FakeWorker, make_add_request, make_config


class _Inbox:
    def recv_nowait(self) -> bytes:
        raise anyio.WouldBlock


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


class _Workers:
    """Runs each step at once but hands its result back only when asked (`recv_output`), the
    moment the real EngineCore blocks on its workers; `during_step` runs just before, as if
    a request had arrived while the step was running."""

    has_remote_nodes = False  # one node

    def __init__(self) -> None:
        self.model = FakeWorker()
        self.sent: list[SchedulerOutput] = []
        self.results: deque[ModelRunnerOutput] = deque()
        self.max_in_flight = 0
        self.during_step: Callable[[], None] | None = None

    def send(self, out: SchedulerOutput) -> None:
        self.sent.append(out)
        self.results.append(self.model.execute(out))
        self.max_in_flight = max(self.max_in_flight, len(self.results))

    def recv_output(self) -> ModelRunnerOutput:
        if self.during_step is not None:
            hook, self.during_step = self.during_step, None
            hook()
        return self.results.popleft()

    def shutdown(self) -> None:
        pass


def _engine() -> tuple[EngineCore, _Workers]:
    config = make_config(async_scheduling=True, max_num_batched_tokens=64)
    workers = _Workers()
    engine = EngineCore(config, 0, _Inbox(), _Outbox(), workers, 64)  # type: ignore[arg-type]
    return engine, workers


def test_a_request_arriving_during_a_prefill_step_joins_the_next_step() -> None:
    engine, workers = _engine()
    engine.scheduler.add_request(make_add_request("a", list(range(1, 41)), max_tokens=8))
    engine.step()  # schedules a's prefill, returns at once: the queue has room
    assert len(workers.sent) == 1

    def arrive() -> None:  # the EngineCore drains its input after the step, as in run()
        engine.scheduler.add_request(make_add_request("b", list(range(100, 130)), max_tokens=8))

    workers.during_step = arrive
    engine.step()  # a prefill step is in flight: no step scheduled ahead of it
    assert len(workers.sent) == 1 and not workers.results
    engine.step()
    second = workers.sent[1]
    assert [r.req_id for r in second.scheduled_new_reqs] == ["b"]
    assert second.num_scheduled_tokens == {"a": 1, "b": 30}


def test_decode_steps_are_still_scheduled_ahead() -> None:
    engine, workers = _engine()
    engine.scheduler.add_request(make_add_request("a", list(range(1, 21)), max_tokens=6))
    for _ in range(20):
        if not engine.scheduler.has_unfinished_requests() and not engine._in_flight:
            break
        engine.step()
    assert workers.max_in_flight == 2  # a decode step n+1 was sent before step n's result
    tokens = [t for out in workers.sent for t in out.num_scheduled_tokens.values()]
    assert tokens[0] == 20 and set(tokens[1:]) == {1}


def test_profile_steps_splits_decode_and_prefill_steps(caplog) -> None:
    """`--profile-steps` logs every 200 steps: their wall time and the share of it with no step
    under way, the host share, and the decode-only steps apart from those that carry prefill
    tokens (their counts, rows, tokens and time)."""
    import logging

    import msgspec

    engine, workers = _engine()
    engine.config = msgspec.structs.replace(engine.config, profile_steps=True)
    for i in range(10):  # 10 prompts of 20 tokens, 210 new tokens each
        engine.scheduler.add_request(
            make_add_request(f"r{i}", list(range(1 + i, 21 + i)), max_tokens=210)
        )
    with caplog.at_level(logging.INFO, logger="vx.core.engine_core"):
        for _ in range(400):
            if not engine.scheduler.has_unfinished_requests() and not engine._in_flight:
                break
            engine.step()
    kinds = {"decode": 0, "prefill": 0}
    for out in workers.sent[:200]:
        rows = len(out.num_scheduled_tokens)
        kinds["decode" if out.total_num_scheduled_tokens == rows else "prefill"] += 1
    lines = [r.getMessage() for r in caplog.records if "profile over 200 steps" in r.getMessage()]
    assert len(workers.sent) >= 200 and len(lines) == 1, (len(workers.sent), lines)
    assert f"decode steps {kinds['decode']}:" in lines[0]
    assert f"prefill steps {kinds['prefill']}:" in lines[0]
    assert kinds["prefill"] > 0 and "host share" in lines[0]
    assert re.search(r"profile over 200 steps \([0-9.]+ s, idle [0-9.]+%\)", lines[0]), lines[0]
