"""The dashboard's side of the front: static pages, the /v1/engine/events feed, the block-map
poller's costs (no engine call while nobody watches) and the progress log line."""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from tests.http.conftest import running_app
from tests.http.test_http_disconnect import served
from vx import messages
from vx.errors import EngineDeadError
from vx.http.dashboard import EngineEvents, StatsLogger, front_counters, make_lifespan
from vx.http.metrics import Metrics
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

HTML = {"accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


async def test_pages_are_public_and_api_clients_keep_the_json_root(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, api_keys=["sk-1"]) as h, h.http() as c:
        page = await c.get("/", headers=HTML)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/static/chat.js" in page.text
        root = await c.get("/", headers={"authorization": "Bearer sk-1"})
        assert root.json()["name"] == "vx"  # curl, httpx, SDKs: Accept */* gets the JSON root
        dash = await c.get("/dashboard")
        assert dash.status_code == 200 and "/static/dashboard.js" in dash.text
        for name, kind in [("chat.js", "javascript"), ("dashboard.js", "javascript"),
                           ("style.css", "text/css")]:  # fmt: skip
            r = await c.get(f"/static/{name}")
            assert r.status_code == 200 and kind in r.headers["content-type"], name
        etag = r.headers["etag"]
        assert (
            await c.get("/static/style.css", headers={"if-none-match": etag})
        ).status_code == 304
        assert (await c.head("/static/style.css")).content == b""
        # Unknown files and tricks fall through to the API: auth first, then the 404 envelope.
        assert (await c.get("/static/../app.py")).status_code == 401
        missing = await c.get("/static/nope.js", headers={"authorization": "Bearer sk-1"})
        assert missing.status_code == 404 and "error" in missing.json()
        # The feed is data: it needs the key.
        assert (await c.get("/v1/engine/events")).status_code == 401


async def test_event_snapshot_after_a_request(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer) as h, h.http() as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code == 200
        await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10**6})  # 400
        # Draining ends the feed after one snapshot (the in-process transport buffers whole
        # responses; the streaming itself is tested over hypercorn below).
        h.client.draining = True
        r = await c.get("/v1/engine/events")
    assert r.headers["content-type"].startswith("text/event-stream")
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert len(lines) == 1
    snap = json.loads(lines[0][6:])
    assert snap["draining"] is True and snap["dead"] is False and snap["model"] == "tiny"
    front = snap["front"]
    assert front["received"] == 2 and front["finished"] == {"length": 1.0}
    assert front["rejected"] == {"400": 1.0} and front["aborted"] == {}
    assert front["generation_tokens"] == 5 and front["ttft_count"] == 1
    (engine,) = snap["engines"]
    assert engine["stats"]["num_blocks"] == 64 and engine["stats"]["num_running"] == 0
    assert engine["block_map"] is None  # no lifespan here: no poller


async def test_events_stream_over_hypercorn_and_stop_with_the_drain(tokenizer: Tokenizer) -> None:
    async with (
        running_app(tokenizer, step_s=0.002) as h,
        served(h.app) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        snaps: list[dict[str, Any]] = []
        async with c.stream("GET", "/v1/engine/events") as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    snaps.append(json.loads(line[6:]))
                if len(snaps) == 3:
                    h.client.draining = True  # the feed must end by itself on shutdown
        assert len(snaps) in (3, 4) and snaps[0]["watchers"] == 1
        assert snaps[1]["t"] - snaps[0]["t"] >= 0.09  # at most 10 per second
        h.client.draining = False


class StubClient:
    """An EngineClient stand-in that counts "kv_block_map" calls."""

    def __init__(self) -> None:
        self.num_engines = 1
        self.ready: list[messages.EngineReady] = []
        self.is_dead = False
        self.dead_reason = None
        self.draining = False
        self.num_unfinished = 0
        self.calls = 0
        self.called = anyio.Event()
        self.stats: messages.SchedulerStats | None = None

    def latest_stats(self, i: int) -> messages.SchedulerStats | None:
        return self.stats

    async def call_utility(self, method: str, args: Any = None, engine_index: int = 0) -> Any:
        assert method == "kv_block_map" and args == {"max_cells": 16384}
        if self.is_dead:
            raise EngineDeadError("gone")
        self.calls += 1
        self.called.set()
        self.called = anyio.Event()
        return {"num_blocks": 4, "group_size": 1, "cells": "uc..", "cost_s": 1e-5}


def _stats(running: int) -> messages.SchedulerStats:
    return messages.SchedulerStats(
        num_running=running, num_waiting=0, num_preempted_total=0, kv_usage=0.25, num_blocks=4,
        num_free_blocks=3, num_cached_free_blocks=1, prefix_queries_total=0, prefix_hits_total=0,
    )  # fmt: skip


async def test_block_map_polled_only_while_watched() -> None:
    client = StubClient()
    events = EngineEvents(client, Metrics(client, "m"), interval_s=0.01)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(events.poll_block_maps)
        await anyio.wait_all_tasks_blocked()
        assert client.calls == 0  # nobody watches: the engine is never asked
        events.num_watchers = 1
        events._wake.set()
        with anyio.fail_after(5):
            await client.called.wait()
        assert events.block_maps[0] == {
            "num_blocks": 4, "group_size": 1, "cells": "uc..", "t": events.block_maps[0]["t"]
        }  # fmt: skip
        # A new stats object (a step ran) makes the next poll due; the same one does not,
        # until MAX_MAP_AGE_S has passed.
        for running in (1, 2):
            client.stats = _stats(running)
            with anyio.fail_after(5):
                await client.called.wait()
        before = client.calls
        await anyio.sleep(0.1)  # ten intervals with an unchanged engine
        assert client.calls == before
        events.num_watchers = 0
        client.stats = _stats(3)
        await anyio.sleep(0.05)  # the poller must stay parked though the engine changed
        assert client.calls in (before, before + 1)  # at most the poll already under way
        tg.cancel_scope.cancel()


def test_stats_logger_line_quiet_when_idle() -> None:
    client = StubClient()
    metrics = Metrics(client, "m")  # type: ignore[arg-type]
    log = StatsLogger(client, metrics)  # type: ignore[arg-type]
    a = log.sample()
    b = log.sample()
    assert StatsLogger.line(a, b) is None
    metrics.generation_tokens.inc(500)
    metrics.prompt_tokens.inc(100)
    metrics.aborted("client_disconnect")
    client.stats = _stats(2)
    c = log.sample()
    c.t = b.t + 5.0
    text = StatsLogger.line(b, c)
    assert text is not None
    assert "generation 100.0 tok/s" in text and "prompt 20.0 tok/s" in text
    assert "running 2, waiting 0" in text and "KV cache 25.0%" in text
    assert "aborted 1 client_disconnect" in text and "hit rate n/a" in text
    assert "drafts" not in text
    assert front_counters(metrics)["aborted"] == {"client_disconnect": 1.0}
    # speculative decoding: the share of the interval's drafts accepted
    client.stats = msgspec.structs.replace(
        _stats(2), spec_num_draft_tokens_total=40, spec_num_accepted_tokens_total=30
    )
    d = log.sample()
    d.t = c.t + 5.0
    assert "drafts accepted 75.0%" in (StatsLogger.line(c, d) or "")


async def test_stats_logger_logs_while_busy(caplog: pytest.LogCaptureFixture) -> None:
    client = StubClient()
    metrics = Metrics(client, "m")  # type: ignore[arg-type]
    log = StatsLogger(client, metrics, interval_s=0.01)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="vx.http.dashboard")
    async with anyio.create_task_group() as tg:
        tg.start_soon(log.run)
        await anyio.sleep(0.05)
        assert not caplog.records  # idle: silent
        client.stats = _stats(1)
        with anyio.fail_after(5):
            while not caplog.records:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert "running 1" in caplog.records[0].getMessage()


async def test_lifespan_task_failure_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    ran = anyio.Event()

    async def broken() -> None:
        raise KeyError("boom")

    async def steady() -> None:
        ran.set()
        await anyio.sleep_forever()

    async with make_lifespan(broken, steady)(None):
        with anyio.fail_after(5):
            await ran.wait()
    assert "background task" in caplog.text and "boom" in caplog.text
