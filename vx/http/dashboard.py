"""The browser pages, the dashboard's engine-event feed, and the front's progress line.

Runs in: the ApiServer process. `EngineEvents.poll_block_maps` and `StatsLogger.run` are tasks
of the app's lifespan task group (`make_lifespan`); the rest runs in request handlers.

`EngineEvents` serves `GET /v1/engine/events`: a `text/event-stream` of JSON snapshots, one
every `interval_s` (10 per second), of every engine's latest `SchedulerStats`, its KV block map,
and the front's cumulative counters (requests received, finished by reason, aborted by cause,
rejected by status; prompt and generation tokens; TTFT and ITL sums). Counters stay cumulative
on purpose: the browser differences successive snapshots into rates and abort events, so a
snapshot it misses loses nothing. Everything except the block map is read from what the front
already holds. The block map costs the engine a "kv_block_map" utility call (O(num_blocks)),
so it is polled only while at least one client watches, at most once per `interval_s`, only
after the engine changed (a new stats object) or once a second, and less often when the call
takes more than `COST_SHARE` of the engine's time: an unwatched dashboard costs the engine
nothing.

`StatsLogger` logs one INFO line every `interval_s` (5 s) while the server is busy
(throughput, running, waiting, KV usage, prefix-cache hit rate) and stays silent while idle.

`UIMiddleware` serves the static pages (the chat at `/` for browsers, `/dashboard`,
`/static/*`) ahead of the API-key check: they are the same files for everyone and hold no
data; every call they make goes through the API, with the key the user typed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mimetypes
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from vx.errors import EngineDeadError
from vx.http.stream import SSEResponse, Write, sse_event

if TYPE_CHECKING:
    from vx.http.engine_client import EngineClient
    from vx.http.metrics import Metrics

logger = logging.getLogger(__name__)

STATIC_DIR = pathlib.Path(__file__).with_name("static")
#: Seconds between snapshots on one event stream (and between block-map polls at most).
EVENT_INTERVAL_S = 0.1
#: Cells in one engine's block map; bigger pools are shown in groups of blocks.
MAX_MAP_CELLS = 16384
#: The largest share of an engine's time the block-map calls may take.
COST_SHARE = 0.02
#: An unchanged engine's block map is still refreshed this often (a prefix-cache reset, say).
MAX_MAP_AGE_S = 1.0

_ENCODER = msgspec.json.Encoder()

# Prometheus sample -> snapshot counter.
_TOTALS = {
    "vx:requests_received_total": "received",
    "vx:prompt_tokens_total": "prompt_tokens",
    "vx:generation_tokens_total": "generation_tokens",
    "vx:time_to_first_token_seconds_sum": "ttft_sum",
    "vx:time_to_first_token_seconds_count": "ttft_count",
    "vx:inter_token_latency_seconds_sum": "itl_sum",
    "vx:inter_token_latency_seconds_count": "itl_count",
}
# Prometheus sample -> (snapshot dict, the label it is keyed by).
_LABELLED = {
    "vx:request_success_total": ("finished", "finished_reason"),
    "vx:request_aborted_total": ("aborted", "cause"),
    "vx:requests_rejected_total": ("rejected", "status"),
}


def front_counters(metrics: Metrics) -> dict[str, Any]:
    """The front's cumulative counters, read from its Prometheus registry."""
    out: dict[str, Any] = {k: 0.0 for k in _TOTALS.values()}
    for key, _ in _LABELLED.values():
        out[key] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            name = _TOTALS.get(sample.name)
            if name is not None:
                out[name] += sample.value
                continue
            labelled = _LABELLED.get(sample.name)
            if labelled is not None and sample.value:
                key, label = labelled
                value = sample.labels.get(label, "?")
                out[key][value] = out[key].get(value, 0.0) + sample.value
    return out


class EngineEvents:
    """The dashboard's feed (see the module docstring).

    Invariants: `num_watchers` counts the event streams now open; the engines get
    "kv_block_map" calls only while it is positive, one engine at a time, at most once per
    `interval_s` each; `block_maps[i]` is engine i's latest map (None before the first).
    """

    def __init__(
        self,
        client: EngineClient,
        metrics: Metrics,
        *,
        model_name: str = "",
        interval_s: float = EVENT_INTERVAL_S,
        max_cells: int = MAX_MAP_CELLS,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._model_name = model_name
        self.interval_s = interval_s
        self.max_cells = max_cells
        self.num_watchers = 0
        self.num_polls = 0
        self.block_maps: list[dict[str, Any] | None] = [None] * client.num_engines
        self._polled: list[tuple[object, float]] = [(None, 0.0)] * client.num_engines
        self._wake = anyio.Event()
        self._cache: tuple[float, bytes] = (-1.0, b"")

    # ── snapshots ──
    def snapshot(self) -> dict[str, Any]:
        client = self._client
        engines = []
        for i in range(client.num_engines):
            ready = next((r for r in client.ready if r.engine_index == i), None)
            stats = client.latest_stats(i)
            engines.append(
                {
                    "index": i,
                    "num_blocks": ready.num_blocks if ready else 0,
                    "block_size": ready.block_size if ready else 0,
                    "max_num_seqs": ready.max_num_seqs if ready else 0,
                    "max_num_batched_tokens": ready.max_num_batched_tokens if ready else 0,
                    "stats": msgspec.structs.asdict(stats) if stats is not None else None,
                    "block_map": self.block_maps[i],
                }
            )
        return {
            "t": time.time(),
            "model": self._model_name,
            "dead": client.is_dead,
            "dead_reason": client.dead_reason,
            "draining": client.draining,
            "in_flight": client.num_unfinished,
            "watchers": self.num_watchers,
            "interval_s": self.interval_s,
            "front": front_counters(self._metrics),
            "engines": engines,
        }

    def snapshot_bytes(self) -> bytes:
        # Several dashboards share one snapshot per half interval instead of building their own.
        now = time.monotonic()
        if now - self._cache[0] >= self.interval_s / 2:
            self._cache = (now, _ENCODER.encode(self.snapshot()))
        return self._cache[1]

    # ── the endpoint ──
    async def stream(self, request: Request) -> Any:
        """GET /v1/engine/events: the SSE feed; it ends when the server drains or dies."""

        async def produce(write: Write) -> None:
            self.num_watchers += 1
            self._wake.set()
            try:
                while True:
                    await write(sse_event(self.snapshot_bytes()))
                    if self._client.draining or self._client.is_dead:
                        return  # a shutdown must not wait for dashboards to leave
                    await anyio.sleep(self.interval_s)
            finally:
                self.num_watchers -= 1

        return SSEResponse(produce, lambda cause: None, keepalive_s=15.0, stall_timeout_s=30.0)

    # ── the poller (a lifespan task) ──
    async def poll_block_maps(self) -> None:
        """Keep `block_maps` fresh while anyone watches; idle (no engine calls) otherwise."""
        client = self._client
        while not client.is_dead:
            if self.num_watchers == 0:
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            started = time.monotonic()
            cost = 0.0
            for i in range(client.num_engines):
                stats = client.latest_stats(i)
                last_stats, last_t = self._polled[i]
                if stats is last_stats and started - last_t < MAX_MAP_AGE_S:
                    continue  # no step and no abort since: the pool cannot have changed
                try:
                    result = await client.call_utility(
                        "kv_block_map", {"max_cells": self.max_cells}, engine_index=i
                    )
                except EngineDeadError:
                    return
                except RuntimeError as e:  # an engine without the method: no map, no retries
                    logger.warning("dashboard block map unavailable: %s", e)
                    return
                self.num_polls += 1
                self._polled[i] = (stats, started)
                cost = max(cost, float(result.pop("cost_s", 0.0)))  # type: ignore[arg-type]
                result["t"] = time.time()
                self.block_maps[i] = result
            elapsed = time.monotonic() - started
            await anyio.sleep(max(self.interval_s - elapsed, cost / COST_SHARE - elapsed, 0.0))


@dataclass
class _Sample:
    t: float
    front: dict[str, Any]
    running: int = 0
    waiting: int = 0
    preempted: int = 0
    queries: int = 0
    hits: int = 0
    drafts: int = 0
    accepted: int = 0
    kv: list[float] = field(default_factory=list)


class StatsLogger:
    """One INFO progress line per `interval_s` while busy; none while idle.

    Busy means: tokens flowed, requests arrived or ended, or some engine has requests running
    or waiting, during the interval.
    """

    def __init__(self, client: EngineClient, metrics: Metrics, interval_s: float = 5.0) -> None:
        self._client = client
        self._metrics = metrics
        self.interval_s = interval_s

    def sample(self) -> _Sample:
        s = _Sample(time.monotonic(), front_counters(self._metrics))
        for i in range(self._client.num_engines):
            stats = self._client.latest_stats(i)
            if stats is None:
                s.kv.append(0.0)
                continue
            s.running += stats.num_running
            s.waiting += stats.num_waiting
            s.preempted += stats.num_preempted_total
            s.queries += stats.prefix_queries_total
            s.hits += stats.prefix_hits_total
            s.drafts += stats.spec_num_draft_tokens_total
            s.accepted += stats.spec_num_accepted_tokens_total
            s.kv.append(stats.kv_usage)
        return s

    @staticmethod
    def line(prev: _Sample, cur: _Sample) -> str | None:
        """The progress line for the interval prev -> cur, or None when it was idle."""
        dt = max(cur.t - prev.t, 1e-9)
        a, b = prev.front, cur.front
        prompt = b["prompt_tokens"] - a["prompt_tokens"]
        gen = b["generation_tokens"] - a["generation_tokens"]
        arrived = b["received"] - a["received"]
        aborted = {k: v - a["aborted"].get(k, 0.0) for k, v in b["aborted"].items()}
        aborted = {k: v for k, v in aborted.items() if v}
        if not (prompt or gen or arrived or aborted or cur.running or cur.waiting):
            return None
        queries, hits = cur.queries - prev.queries, cur.hits - prev.hits
        if not queries:  # nothing looked up in this interval: show the lifetime rate
            queries, hits = cur.queries, cur.hits
        hit_rate = f"{100.0 * hits / queries:.1f}%" if queries else "n/a"
        kv = ", ".join(f"{100.0 * u:.1f}%" for u in cur.kv)
        text = (
            f"throughput: prompt {prompt / dt:.1f} tok/s, generation {gen / dt:.1f} tok/s; "
            f"running {cur.running}, waiting {cur.waiting}; KV cache {kv}; "
            f"prefix cache hit rate {hit_rate}"
        )
        if cur.drafts > prev.drafts:
            share = (cur.accepted - prev.accepted) / (cur.drafts - prev.drafts)
            text += f"; drafts accepted {100.0 * share:.1f}%"
        if cur.preempted > prev.preempted:
            text += f"; preempted {cur.preempted - prev.preempted}"
        if aborted:
            text += "; aborted " + ", ".join(f"{int(v)} {k}" for k, v in sorted(aborted.items()))
        return text

    async def run(self) -> None:
        prev = self.sample()
        while not self._client.is_dead:
            await anyio.sleep(self.interval_s)
            cur = self.sample()
            text = self.line(prev, cur)
            if text is not None:
                logger.info("%s", text)
            prev = cur


def make_lifespan(
    *tasks: Callable[[], Awaitable[None]],
) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """A starlette lifespan running `tasks` in one task group while the app serves.

    A task that fails is logged and dropped: a dashboard or log line never stops the server.
    """

    async def guarded(task: Callable[[], Awaitable[None]]) -> None:
        try:
            await task()
        except Exception:
            logger.exception("background task %s failed", getattr(task, "__qualname__", task))

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        # NOTE: the task group spans the yield of a context manager (entered and left by the
        # same server task), not of an iterator, so no cancellation can leak into a consumer.
        async with anyio.create_task_group() as tg:
            for task in tasks:
                tg.start_soon(guarded, task)
            yield
            tg.cancel_scope.cancel()

    return lifespan


@dataclass(frozen=True)
class _Asset:
    body: bytes
    content_type: str
    etag: str


class UIMiddleware:
    """Serves the static pages ahead of auth: GET `/` (browsers only: an Accept of text/html;
    API clients still get the JSON root), `/dashboard` and `/static/<file>`.

    Invariant: only the files in `static_dir` at start-up are served, from memory (no path from
    a request ever reaches the filesystem); anything else passes to the wrapped app.
    """

    PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}

    def __init__(self, app: ASGIApp, static_dir: pathlib.Path = STATIC_DIR) -> None:
        self.app = app
        self._assets: dict[str, _Asset] = {}
        for path in sorted(static_dir.glob("*")) if static_dir.is_dir() else []:
            if path.is_file():
                body = path.read_bytes()
                kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                if kind.startswith("text/") or kind.endswith("javascript"):
                    kind += "; charset=utf-8"
                etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
                self._assets[path.name] = _Asset(body, kind, etag)

    def _asset_for(self, scope: Scope) -> _Asset | None:
        path: str = scope["path"]
        if path.startswith("/static/"):
            return self._assets.get(path[len("/static/") :])
        page = self.PAGES.get(path)
        if page is None:
            return None
        if path == "/":
            accept = dict(scope.get("headers", ())).get(b"accept", b"")
            if b"text/html" not in accept:
                return None
        return self._assets.get(page)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        asset = None
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            asset = self._asset_for(scope)
        if asset is None:
            await self.app(scope, receive, send)
            return
        fresh = dict(scope.get("headers", ())).get(b"if-none-match") == asset.etag.encode()
        headers = [
            (b"content-type", asset.content_type.encode()),
            (b"etag", asset.etag.encode()),
            (b"cache-control", b"no-cache"),
            (b"x-content-type-options", b"nosniff"),
        ]
        if fresh:
            await send({"type": "http.response.start", "status": 304, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        headers.append((b"content-length", str(len(asset.body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        body = b"" if scope["method"] == "HEAD" else asset.body
        await send({"type": "http.response.body", "body": body})
