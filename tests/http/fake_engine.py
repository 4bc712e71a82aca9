"""A fake EngineCore for the front's tests: a thread on real vx rings, deterministic tokens.

Runs in: the pytest process (a thread). It speaks the real protocol (`vx.messages` over
`vx.ipc.ring`, encoded by `vx.ipc.codec`): it answers EngineReady, then every `step_s` gives each running
request its next token. Request k-th output token is `reply_ids[k % len(reply_ids)]`; after
`len(reply_ids)` tokens it emits EOS (unless `ignore_eos`), and it honours max_tokens,
stop_token_ids, logprobs, prompt_logprobs and aborts. Tests read `received` (every input
message, in order) and wait on `wait_for(...)` conditions instead of sleeping.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from vx import messages
from vx.ipc import codec
from vx.ipc.ring import RingReader, RingWriter

RING_PREFIX = "vxhttptest"


@dataclass
class _Running:
    req: messages.AddRequest
    num_generated: int = 0
    sent_prompt_logprobs: bool = False


class FakeEngine:
    """Invariant: `received` lists every decoded input in ring order; `running` holds exactly
    the requests added and neither finished nor aborted."""

    def __init__(
        self,
        reply_ids: list[int],
        *,
        eos_token_id: int | None,
        engine_index: int = 0,
        max_model_len: int = 256,
        step_s: float = 0.0,
        capacity: int = 1 << 20,
        worker_pids: list[int] | None = None,
    ) -> None:
        self.reply_ids = reply_ids
        #: What EngineReady reports as this engine's Workers.
        self.worker_pids = list(worker_pids or [])
        self.eos_token_id = eos_token_id
        self.engine_index = engine_index
        self.max_model_len = max_model_len
        self.step_s = step_s
        #: Request ids whose next step ends them with finish_reason "error".
        self.fail_ids: set[str] = set()
        #: Cleared: the engine keeps requests but produces nothing (a stuck or slow engine).
        self.gate = threading.Event()
        self.gate.set()
        self.received: list[messages.EngineCoreInput] = []
        self.running: dict[str, _Running] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        # front -> engine, engine -> front
        self.to_engine = RingWriter.create(capacity=capacity, name_prefix=RING_PREFIX)
        self._in = RingReader.attach(self.to_engine.handle)
        self._out = RingWriter.create(capacity=capacity, name_prefix=RING_PREFIX)
        self.from_engine = RingReader.attach(self._out.handle)
        self._in_codec = codec.engine_input_codec()
        self._out_codec = codec.engine_event_codec()
        self._thread = threading.Thread(
            target=self._run, name=f"FakeEngine-{engine_index}", daemon=True
        )

    @property
    def rings(self) -> tuple[RingWriter, RingReader]:
        """The front's ends: (writer to the engine, reader from it)."""
        return self.to_engine, self.from_engine

    # ── control ──
    def start(self) -> FakeEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for end in (self._in, self._out, self.to_engine, self.from_engine):
            end.close()

    def send_event(self, event: messages.EngineCoreEvent) -> None:
        self._out.send(self._out_codec.encode(event), timeout=5)

    def die(self, reason: str = "injected failure") -> None:
        """Report EngineDead and stop stepping (as a crashing EngineCore would)."""
        self.gate.clear()
        self.send_event(messages.EngineDead(engine_index=self.engine_index, reason=reason))

    def wait_for(self, predicate: Callable[[FakeEngine], bool], timeout: float = 10.0) -> None:
        """Block until `predicate(self)` holds (checked after every input and step)."""
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self), timeout=timeout):
                raise AssertionError("fake engine condition not reached in time")

    async def wait_for_async(
        self, predicate: Callable[[FakeEngine], bool], timeout: float = 10.0
    ) -> None:
        await anyio.to_thread.run_sync(self.wait_for, predicate, timeout)

    def adds(self) -> list[messages.AddRequest]:
        return [m for m in self.received if isinstance(m, messages.AddRequest)]

    def aborted_ids(self, cause: str | None = None) -> list[str]:
        return [
            i
            for m in self.received
            if isinstance(m, messages.AbortRequests) and (cause is None or m.cause == cause)
            for i in m.request_ids
        ]

    # ── the engine thread ──
    def _run(self) -> None:
        self.send_event(
            messages.EngineReady(
                engine_index=self.engine_index, num_blocks=64, block_size=16,
                max_model_len=self.max_model_len, max_num_batched_tokens=8192, max_num_seqs=256,
                kv_cache_bytes=1 << 20, engine_pid=os.getpid(), worker_pids=self.worker_pids,
                async_scheduling=False,
            )
        )  # fmt: skip
        next_step = time.monotonic()
        while not self._stop.is_set():
            busy = bool(self.running) and self.gate.is_set()
            timeout = max(0.0, next_step - time.monotonic()) if busy else 0.02
            try:
                data = self._in.recv(timeout=timeout)
            except TimeoutError:
                data = None
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            while data is not None:
                self._handle(self._in_codec.decode(data))
                try:
                    data = self._in.recv_nowait()
                except anyio.WouldBlock:
                    data = None
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
            if self.running and self.gate.is_set() and time.monotonic() >= next_step:
                self._step()
                next_step = time.monotonic() + self.step_s

    def _handle(self, msg: messages.EngineCoreInput) -> None:
        with self._cond:
            self.received.append(msg)
            if isinstance(msg, messages.AddRequest):
                self.running[msg.request_id] = _Running(msg)
            elif isinstance(msg, messages.AbortRequests):
                for request_id in msg.request_ids:
                    self.running.pop(request_id, None)
            elif isinstance(msg, messages.UtilityRequest):
                if msg.method == "get_stats":
                    result = messages.UtilityResult(
                        call_id=msg.call_id, result={"num_running": len(self.running)}
                    )
                elif msg.method == "reset_prefix_cache":  # refused while requests hold blocks
                    result = messages.UtilityResult(
                        call_id=msg.call_id, result={"ok": not self.running}
                    )
                else:
                    result = messages.UtilityResult(
                        call_id=msg.call_id, error=f"unknown method {msg.method}"
                    )
                self.send_event(result)
            self._cond.notify_all()

    def _step(self) -> None:
        outputs = []
        with self._cond:
            for request_id, r in list(self.running.items()):
                outputs.append(self._next_output(r))
                if outputs[-1].finish_reason is not None:
                    del self.running[request_id]
            stats = messages.SchedulerStats(
                num_running=len(self.running), num_waiting=0, num_preempted_total=0,
                kv_usage=len(self.running) / 64, num_blocks=64, num_free_blocks=64 - len(self.running),
                num_cached_free_blocks=0, prefix_queries_total=10, prefix_hits_total=5,
            )  # fmt: skip
            self.send_event(
                messages.EngineCoreOutputs(
                    engine_index=self.engine_index, outputs=outputs, timestamp=time.monotonic(),
                    scheduler_stats=stats,
                )
            )  # fmt: skip
            self._cond.notify_all()

    def _next_output(self, r: _Running) -> messages.EngineCoreOutput:
        req, params = r.req, r.req.sampling_params
        if req.request_id in self.fail_ids:
            return messages.EngineCoreOutput(req.request_id, [], "error", error="injected error")
        k = r.num_generated
        if k == len(self.reply_ids) and not params.ignore_eos and self.eos_token_id is not None:
            token = self.eos_token_id
        else:
            token = self.reply_ids[k % len(self.reply_ids)]
        r.num_generated += 1
        finish = stop_reason = None
        if token == self.eos_token_id and not params.ignore_eos:
            finish, stop_reason = "stop", token
        elif token in params.stop_token_ids and r.num_generated > params.min_tokens:
            finish, stop_reason = "stop", token
        elif params.max_tokens is not None and r.num_generated >= params.max_tokens:
            finish = "length"
        logprobs = None
        if params.logprobs is not None:
            alts = [(token + j + 1) % 100 for j in range(params.logprobs)]
            logprobs = messages.Logprobs(
                token_ids=[[token, *alts]],
                logprobs=[[-0.5, *(-1.0 - j for j in range(params.logprobs))]],
                ranks=[1],
            )
        prompt_logprobs = None
        if params.prompt_logprobs is not None and not r.sent_prompt_logprobs:
            r.sent_prompt_logprobs = True
            ids = req.prompt_token_ids[1:]
            prompt_logprobs = messages.Logprobs(
                token_ids=[[t] for t in ids], logprobs=[[-2.0] for _ in ids], ranks=[1] * len(ids)
            )
        return messages.EngineCoreOutput(
            req.request_id, [token], finish, stop_reason, logprobs, prompt_logprobs
        )
