"""EngineClient: the ApiServer's handle on its EngineCores, over the vx rings.

Runs in: the ApiServer process, inside the launcher's anyio task group. It imports no vx.core:
everything it knows about an EngineCore arrives as a `vx.messages` event.

One reader task per engine decodes `EngineCoreEvent`s and dispatches each `EngineCoreOutput`
into its request's `RequestStream`, a mailbox that merges deltas when the HTTP side reads slower
than the engine produces. The dispatcher therefore never blocks on a client, and a slow client
costs memory proportional only to the tokens it has not read yet (bounded by max_tokens).

Writes to the engines (`AddRequest`, `AbortRequests`, `UtilityRequest`) are non-blocking: when an
input ring is full, messages wait in a per-engine outbox that a flusher task drains in order, so
`abort_nowait` is safe in `finally` blocks and cancelled scopes, and never loses an abort.
"""

from __future__ import annotations

import array
import collections
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel

from vx import messages
from vx.errors import EngineDeadError
from vx.http.load_balancer import LoadBalancer
from vx.ipc import codec

logger = logging.getLogger(__name__)

#: Messages an engine's outbox may hold before `add_request` refuses new work (503).
MAX_OUTBOX = 4096
#: How often the flusher retries a full input ring.
FLUSH_RETRY_S = 0.001


class EngineBusyError(RuntimeError):
    """The engine's input ring and the outbox are both full (an HTTP 503 with Retry-After)."""


class RingWriterLike(Protocol):
    def send_nowait(self, data: bytes) -> None: ...


class RingReaderLike(Protocol):
    def recv_nowait(self) -> bytes: ...

    async def receive(self) -> bytes: ...


class OutputObserver(Protocol):
    """Receives per-request timings as outputs arrive (the /metrics histograms)."""

    def on_tokens(self, *, num_tokens: int, ttft_s: float | None, itl_s: float | None) -> None: ...


#: Undelivered tokens from which a merged delta keeps its tokens and logprob rows packed in
#: arrays of 2- or 4-byte numbers (`_Segment`) rather than Python lists (a tenth of their bytes
#: or less): only a reader that fell behind (a client that stopped reading) pays for packing,
#: and the front then holds well under the JSON it owes that client.
PACK_FROM_TOKENS = 8


#: The most packed tokens one delivery hands a reader that fell behind: the rest stay packed
#: until its next call. A reader unpacks what it takes into Python lists and formats it into
#: one event, several times the packed bytes, so a reader that stalled, then moved on,
#: must not take thousands of tokens at once.
DELIVER_MAX_TOKENS = 64


class _Segment:
    """A run of packed tokens whose logprob rows share one width (`width` 0: no rows).

    `ints` holds the `n` token ids, then their ranks, then the rows' token ids (row-major), in
    2 bytes each where all fit, else 4; `vals` the rows' logprobs. Each pack makes new
    segments, sized exactly, rather than growing one array: a long stall then leaves no trail
    of outgrown buffers in the allocator.
    Invariant: `len(ints) == n * (1 + (width > 0) + width)` and `len(vals) == n * width`.
    """

    __slots__ = ("ints", "n", "vals", "width")

    def __init__(
        self, ids: list[int], rows_ids: list[list[int]], rows_vals: list[list[float]],
        ranks: list[int], width: int,
    ) -> None:  # fmt: skip
        self.n, self.width = len(ids), width
        ints = [*ids, *ranks, *(i for row in rows_ids for i in row)]
        # The narrowest type that holds them: 2 bytes for every id of a vocabulary of up to
        # 65,536 tokens.
        narrow = not ints or (min(ints) >= 0 and max(ints) < 1 << 16)
        self.ints = array.array("H" if narrow else "i", ints)
        self.vals = array.array("f", [v for row in rows_vals for v in row])

    @property
    def ids(self) -> list[int]:
        return self.ints[: self.n].tolist()

    @property
    def ranks(self) -> list[int]:
        return self.ints[self.n : 2 * self.n].tolist() if self.width else []

    def rows(self, vals: bool) -> list[list[Any]]:
        w = self.width
        flat, start = (self.vals, 0) if vals else (self.ints, 2 * self.n)
        if not w:
            return []
        return [flat[start + i * w : start + (i + 1) * w].tolist() for i in range(self.n)]


class RequestDelta:
    """Everything a request gained since the consumer last looked (merged engine outputs).

    Logprob row i belongs to token i: the sampled token first, then the top-k. Past
    `PACK_FROM_TOKENS` tokens the older tokens, ranks and rows live in packed segments
    (`_Segment`), the newer ones in lists; the public attributes read both, oldest first.
    Invariant: 4-byte floats hold the logprobs exactly, since the Worker computes them in fp32.
    """

    __slots__ = (
        "_row_ids",
        "_row_vals",
        "_segments",
        "_tail_ranks",
        "_tail_tokens",
        "error",
        "finish_reason",
        "num_cached_tokens",
        "prompt_logprobs",
        "stop_reason",
    )

    def __init__(self) -> None:
        self._tail_tokens: list[int] = []
        self._row_ids: list[list[int]] = []
        self._row_vals: list[list[float]] = []
        self._tail_ranks: list[int] = []
        self._segments: list[_Segment] = []
        self.prompt_logprobs: messages.Logprobs | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.error: str | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def new_token_ids(self) -> list[int]:
        if not self._segments:
            return self._tail_tokens
        return [t for s in self._segments for t in s.ids] + self._tail_tokens

    @property
    def logprob_token_ids(self) -> list[list[int]]:
        return [r for s in self._segments for r in s.rows(False)] + self._row_ids

    @property
    def logprobs(self) -> list[list[float]]:
        return [r for s in self._segments for r in s.rows(True)] + self._row_vals

    @property
    def ranks(self) -> list[int]:
        return [r for s in self._segments for r in s.ranks] + self._tail_ranks

    def take_head(self, max_tokens: int) -> RequestDelta | None:
        """Split off the oldest packed segments, `max_tokens` tokens or fewer (at least one
        segment), when more than that many are held; else None, and the delta stays whole.
        The head carries the prompt logprobs; the finish stays with the rest."""
        segments = self._segments
        if not segments or sum(g.n for g in segments) + len(self._tail_tokens) <= max_tokens:
            return None
        k, n = 1, segments[0].n
        while k < len(segments) and n + segments[k].n <= max_tokens:
            n += segments[k].n
            k += 1
        head = RequestDelta()
        head._segments, self._segments = segments[:k], segments[k:]
        head.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        head.num_cached_tokens = self.num_cached_tokens
        return head

    def merge(self, out: messages.EngineCoreOutput) -> None:
        self._tail_tokens.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            self._row_ids.extend(out.new_logprobs.token_ids)
            self._row_vals.extend(out.new_logprobs.logprobs)
            self._tail_ranks.extend(out.new_logprobs.ranks)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error = out.error
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if len(self._tail_tokens) >= PACK_FROM_TOKENS:
            self._pack()

    def _pack(self) -> None:
        """Move the list-held tokens, ranks and rows to new segments (one per row width)."""
        tokens, ids, vals, ranks = (
            self._tail_tokens, self._row_ids, self._row_vals, self._tail_ranks,
        )  # fmt: skip
        self._tail_tokens, self._row_ids, self._row_vals, self._tail_ranks = [], [], [], []
        if not ids:
            self._segments.append(_Segment(tokens, [], [], [], 0))
            return
        # One row a token (the Worker's invariant); a width changes only between requests'
        # parameters, so this splits nothing in practice.
        a = 0
        while a < len(ids):
            w, b = len(ids[a]), a + 1
            while b < len(ids) and len(ids[b]) == w:
                b += 1
            self._segments.append(_Segment(tokens[a:b], ids[a:b], vals[a:b], ranks[a:b], w))
            a = b


class RequestStream:
    """The mailbox of one engine request, written by the dispatcher, read by one HTTP task.

    Invariants: at most `limit` undelivered deltas are kept (newer outputs merge into the last
    one); after a delta with `finish_reason` is queued nothing more is accepted; `get()` after
    the final delta has been delivered raises `anyio.EndOfStream`.
    """

    __slots__ = (
        "_closed",
        "_delivered_final",
        "_event",
        "_limit",
        "_queue",
        "arrival_time",
        "engine_index",
        "first_token_time",
        "last_token_time",
        "num_output_tokens",
        "request_id",
        "scheduled_time",
    )

    def __init__(self, request_id: str, engine_index: int, *, limit: int = 1) -> None:
        self.request_id = request_id
        self.engine_index = engine_index
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        #: When the EngineCore first scheduled it (epoch seconds; its clock is this host's).
        self.scheduled_time: float | None = None
        self._limit = max(1, limit)
        self._queue: collections.deque[RequestDelta] = collections.deque()
        self._event = anyio.Event()
        self._closed = False
        self._delivered_final = False

    @property
    def finished(self) -> bool:
        """True once the final delta is queued (the engine finished, aborted or died)."""
        return self._closed

    def put(self, out: messages.EngineCoreOutput) -> None:
        if self._closed:
            return
        if self._queue and len(self._queue) >= self._limit:
            self._queue[-1].merge(out)
        else:
            delta = RequestDelta()
            delta.merge(out)
            self._queue.append(delta)
        if out.finish_reason is not None:
            self._closed = True
        self._event.set()

    def put_final(self, finish_reason: str, error: str | None = None) -> None:
        """End the stream from the front (engine death, abort): wakes the reader at once."""
        self.put(
            messages.EngineCoreOutput(
                request_id=self.request_id,
                new_token_ids=[],
                finish_reason=finish_reason,
                error=error,
            )
        )

    def get_nowait(self) -> RequestDelta:
        if self._queue:
            head = self._queue[0].take_head(DELIVER_MAX_TOKENS)
            if head is not None:
                return head
            delta = self._queue.popleft()
            if delta.finished:
                self._delivered_final = True
            return delta
        if self._delivered_final:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def get(self) -> RequestDelta:
        """The merged delta since the last call; waits while there is none.

        Cancel-safe: cancellation can only strike while waiting, before a delta is taken.
        NOTE: when a delta is ready this returns without a scheduling point (unlike a trio
        checkpoint): its callers always await a socket write right after, and the extra pass
        through the event loop cost a measurable share of the front's CPU under load.
        """
        while True:
            try:
                return self.get_nowait()
            except anyio.WouldBlock:
                await self._event.wait()
                self._event = anyio.Event()


class EngineClient:
    """Routes requests to EngineCores and their outputs back to per-request mailboxes.

    Invariants: every id in `_streams` belongs to a request the engine may still be running;
    a stream leaves `_streams` exactly once (finished, aborted, or the engine died) and then
    its engine's load count drops by one; once `is_dead`, no request is admitted and no stream
    is left open.
    """

    def __init__(
        self,
        engines: list[tuple[Any, Any]],
        *,
        mailbox_limit: int = 1,
    ) -> None:
        if not engines:
            raise ValueError("EngineClient needs at least one engine")
        self._writers = [w for w, _ in engines]
        self._readers = [r for _, r in engines]
        self._mailbox_limit = mailbox_limit
        self._encoder = codec.engine_input_codec()
        self._decoder = codec.engine_event_codec()
        self._streams: dict[str, RequestStream] = {}
        self._load = [0] * len(engines)
        self._balancer = LoadBalancer(len(engines))
        self._outbox: list[collections.deque[bytes]] = [collections.deque() for _ in engines]
        self._outbox_event = anyio.Event()
        self._ready: dict[int, messages.EngineReady] = {}
        self._all_ready = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._stats: dict[int, messages.SchedulerStats] = {}
        self._call_ids = itertools.count()
        self._calls: dict[int, tuple[anyio.Event, list[messages.UtilityResult]]] = {}
        self.is_dead = False
        self.dead_reason: str | None = None
        #: Set by the launcher on SIGTERM: /health and new requests answer 503.
        self.draining = False
        self.observer: OutputObserver | None = None
        self._readers_scope: anyio.CancelScope | None = None
        #: Who hears of an engine failure (EngineDead, a broken or closed ring) with its reason
        #: and exit code: the launcher, which names one cause from every child's exit and then
        #: calls `mark_dead`. Without one, the client marks itself dead at once.
        self.on_failure: Callable[[str, int], None] | None = None

    # ─────────────────────────── state ───────────────────────────

    @property
    def ready(self) -> list[messages.EngineReady]:
        return [self._ready[i] for i in sorted(self._ready)]

    @property
    def is_ready(self) -> bool:
        """Every engine sent EngineReady (and stays so once dead: it says it had started)."""
        return len(self._ready) == len(self._readers)

    @property
    def max_model_len(self) -> int:
        return min(r.max_model_len for r in self._ready.values()) if self._ready else 0

    @property
    def num_engines(self) -> int:
        return len(self._writers)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def latest_stats(self, engine_index: int) -> messages.SchedulerStats | None:
        return self._stats.get(engine_index)

    async def wait_ready(self) -> bool:
        """Wait until every engine sent EngineReady (True) or the client is dead (False)."""
        await self._all_ready.wait()
        return not self.is_dead

    async def wait_idle(self) -> None:
        """Wait until no request is in flight (used to drain on SIGTERM)."""
        while self._streams:
            await self._idle.wait()

    def mark_dead(self, reason: str) -> None:
        """Fail every open stream and utility call; later requests get EngineDeadError."""
        if self.is_dead:
            return
        self.is_dead = True
        self.dead_reason = reason
        # The caller logged the cause (the launcher's one ERROR line, or `_engine_failed`).
        logger.debug("engine marked dead: %s", reason)
        for stream in list(self._streams.values()):
            stream.put_final(messages.FinishReason.ERROR, f"engine dead: {reason}")
        self._streams.clear()
        self._load = [0] * len(self._load)
        self._idle.set()
        for event, _ in self._calls.values():
            event.set()
        self._all_ready.set()
        if self._readers_scope is not None:
            self._readers_scope.cancel()

    def _engine_failed(self, reason: str, exit_code: int = 0) -> None:
        """An engine reported its death or its ring broke: tell `on_failure`, else die now."""
        if self.is_dead:
            return
        if self.on_failure is not None:
            self.on_failure(reason, exit_code)
            return
        logger.error("engine died: %s", reason)
        self.mark_dead(reason)

    def fail_all(self, message: str, cause: str = "shutdown") -> int:
        """End every open stream with an error (the drain budget ran out) and abort them in
        their engines; returns how many streams were open."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.put_final(messages.FinishReason.ERROR, message)
        self.abort_nowait([s.request_id for s in streams], cause)
        return len(streams)

    # ─────────────────────────── requests ───────────────────────────

    def add_request(self, req: messages.AddRequest) -> RequestStream:
        """Send `req` to the engine `LoadBalancer` picks (queue depth, prefix affinity) and
        return its mailbox.

        Raises:
            EngineDeadError: the engine is dead.
            EngineBusyError: the engine's input is backed up beyond `MAX_OUTBOX` messages.
            ValueError: the request id is already in flight.
        """
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        if req.request_id in self._streams:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        engine_index = 0
        if len(self._load) > 1:
            stats = self._stats
            engine_index = self._balancer.pick(
                req.prompt_token_ids,
                self._load,
                [st.num_waiting if (st := stats.get(i)) else 0 for i in range(len(self._load))],
                (req.cache_salt, req.lora_id),
            )
        if len(self._outbox[engine_index]) >= MAX_OUTBOX:
            raise EngineBusyError("the engine is not keeping up with its input")
        stream = RequestStream(req.request_id, engine_index, limit=self._mailbox_limit)
        self._send(engine_index, self._encoder.encode(req))
        self._streams[req.request_id] = stream
        self._load[engine_index] += 1
        if self._idle.is_set():
            self._idle = anyio.Event()
        return stream

    def abort_nowait(self, request_ids: list[str], cause: str) -> None:
        """Abort in-flight requests in the front and in their engines; never blocks.

        Ids that already finished are ignored, so this is idempotent and safe in `finally`.
        """
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            self._forget(stream)
            stream.put_final(messages.FinishReason.ABORT)
            by_engine.setdefault(stream.engine_index, []).append(request_id)
        if self.is_dead:
            return
        for engine_index, ids in by_engine.items():
            logger.debug("aborting %d request(s) on engine %d: %s", len(ids), engine_index, cause)
            msg = messages.AbortRequests(request_ids=ids, cause=cause)
            self._send(engine_index, self._encoder.encode(msg))

    async def call_utility(
        self, method: str, args: dict[str, object] | None = None, engine_index: int = 0
    ) -> dict[str, object]:
        """Run a control call on one engine and return its result.

        Raises:
            EngineDeadError: the engine died before it answered.
            RuntimeError: the engine reported an error.
        """
        if self.is_dead:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        call_id = next(self._call_ids)
        event = anyio.Event()
        slot: list[messages.UtilityResult] = []
        self._calls[call_id] = (event, slot)
        try:
            req = messages.UtilityRequest(call_id=call_id, method=method, args=args or {})
            self._send(engine_index, self._encoder.encode(req))
            await event.wait()
        finally:
            self._calls.pop(call_id, None)
        if not slot:
            raise EngineDeadError(self.dead_reason or "engine is dead")
        if slot[0].error is not None:
            raise RuntimeError(f"{method} failed: {slot[0].error}")
        return dict(slot[0].result)

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.request_id, None) is not None:
            self._load[stream.engine_index] -= 1
            if not self._streams:
                self._idle.set()

    def _send(self, engine_index: int, data: bytes) -> None:
        outbox = self._outbox[engine_index]
        if not outbox:
            try:
                self._writers[engine_index].send_nowait(data)
                return
            except anyio.WouldBlock:
                pass
            except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
                self._engine_failed(f"engine {engine_index} input ring: {e!r}")
                return
        # NOTE: once anything waits in the outbox, every later message queues behind it, so the
        # engine sees AddRequest and AbortRequests for an id in the order they were sent.
        outbox.append(data)
        self._outbox_event.set()

    async def _flush_outboxes(self) -> None:
        while True:
            await self._outbox_event.wait()
            self._outbox_event = anyio.Event()
            while any(self._outbox) and not self.is_dead:
                for engine_index, outbox in enumerate(self._outbox):
                    while outbox:
                        try:
                            self._writers[engine_index].send_nowait(outbox[0])
                        except anyio.WouldBlock:
                            break
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
                            self._engine_failed(f"engine {engine_index} input ring: {e!r}")
                            break
                        outbox.popleft()
                if any(self._outbox):
                    await anyio.sleep(FLUSH_RETRY_S)

    # ─────────────────────────── reading ───────────────────────────

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Read every engine's events until they close or die.

        Calls `task_status.started()` once every engine sent EngineReady. Returns when all
        readers have stopped (after a clean close, or after the engine was marked dead).

        Raises:
            EngineDeadError: an engine died before every engine was ready.
        """
        started = False
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._flush_outboxes)
            async with anyio.create_task_group() as readers:
                self._readers_scope = readers.cancel_scope
                for i, reader in enumerate(self._readers):
                    readers.start_soon(self._read_loop, i, reader)
                await self._all_ready.wait()
                if not self.is_dead:
                    task_status.started()
                    started = True
            tg.cancel_scope.cancel()
        if not started:
            raise EngineDeadError(f"engine failed during start-up: {self.dead_reason}")

    async def _read_loop(self, engine_index: int, reader: Any) -> None:
        try:
            while not self.is_dead:
                self._handle(await reader.receive())
                # Drain whatever else is already there before waiting again.
                while not self.is_dead:
                    try:
                        data = reader.recv_nowait()
                    except anyio.WouldBlock:
                        break
                    self._handle(data)
        except anyio.EndOfStream:
            if self._streams or len(self._ready) < len(self._readers):
                self._engine_failed(f"engine {engine_index} closed its output ring")
        except anyio.BrokenResourceError:
            self._engine_failed(f"engine {engine_index} died")

    def _handle(self, data: bytes) -> None:
        event = self._decoder.decode(data)
        if isinstance(event, messages.EngineCoreOutputs):
            self._dispatch(event)
        elif isinstance(event, messages.UtilityResult):
            call = self._calls.get(event.call_id)
            if call is not None:
                call[1].append(event)
                call[0].set()
        elif isinstance(event, messages.EngineReady):
            logger.info(
                "engine %d ready: %d KV blocks, max_model_len %d",
                event.engine_index,
                event.num_blocks,
                event.max_model_len,
            )
            self._ready[event.engine_index] = event
            if len(self._ready) == len(self._readers):
                self._all_ready.set()
        elif isinstance(event, messages.EngineDead):
            self._engine_failed(f"engine {event.engine_index}: {event.reason}", event.exit_code)

    def _dispatch(self, batch: messages.EngineCoreOutputs) -> None:
        if batch.scheduler_stats is not None:
            self._stats[batch.engine_index] = batch.scheduler_stats
        now = time.monotonic()
        observer = self.observer
        for out in batch.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                # Already aborted (client left, stop string): the engine may be a step behind.
                logger.debug("output for unknown request %s dropped", out.request_id)
                continue
            if out.scheduled_time is not None and stream.scheduled_time is None:
                stream.scheduled_time = out.scheduled_time
            if out.new_token_ids:
                n = len(out.new_token_ids)
                ttft = itl = None
                if stream.first_token_time is None:
                    stream.first_token_time = now
                    ttft = now - stream.arrival_time
                elif stream.last_token_time is not None:
                    itl = (now - stream.last_token_time) / n
                stream.last_token_time = now
                stream.num_output_tokens += n
                if observer is not None:
                    observer.on_tokens(num_tokens=n, ttft_s=ttft, itl_s=itl)
            stream.put(out)
            if out.finish_reason is not None:
                self._forget(stream)
