"""A small disconnect storm with bad inputs mixed in: nothing is lost, nothing leaks.

Streaming and non-streaming requests over HTTP/1.1 and HTTP/2; a seeded half of the clients
leave at a random point; bad requests are interleaved. Afterwards: every request is accounted
for exactly once (received == rejected + finished + aborted, every admitted request finished
or aborted, the clients' tallies consistent with the server's),
the engine runs nothing, and the front holds no mailbox.
"""

from __future__ import annotations

import random

import anyio
import httpx
import pytest

from tests.http.conftest import running_app
from tests.http.test_http_disconnect import served
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio


async def test_disconnect_storm_accounting(tokenizer: Tokenizer) -> None:
    rng = random.Random(1234)
    tally = {"finished": 0, "rejected": 0, "left": 0}
    async with running_app(tokenizer, step_s=0.002, max_model_len=1024) as h, served(h.app) as url:
        h1 = httpx.AsyncClient(base_url=url, timeout=30)
        h2 = httpx.AsyncClient(base_url=url, timeout=30, http1=False, http2=True)

        async def streaming(c: httpx.AsyncClient, leave_after: int | None) -> None:
            body = {"prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks += 1
                        if leave_after is not None and chunks >= leave_after:
                            tally["left"] += 1
                            return
                    if line == "data: [DONE]":
                        tally["finished"] += 1
                        return
            raise AssertionError("stream ended without [DONE]")

        async def plain(c: httpx.AsyncClient, leave: bool) -> None:
            body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
            if leave:
                with anyio.move_on_after(rng.uniform(0.005, 0.05)):
                    await c.post("/v1/completions", json=body)
                    tally["finished"] += 1  # it finished before the client gave up
                    return
                tally["left"] += 1
                return
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            tally["finished"] += 1

        async def bad(c: httpx.AsyncClient) -> None:
            r = await c.post(
                "/v1/completions", json={"prompt": "x", "temperature": -1, "stream": True}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
            tally["rejected"] += 1

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(48):
                    c = h1 if i % 2 else h2
                    kind = i % 4
                    if kind in (0, 1):
                        tg.start_soon(
                            streaming, c, rng.randint(1, 30) if rng.random() < 0.5 else None
                        )
                    elif kind == 2:
                        tg.start_soon(plain, c, rng.random() < 0.5)
                    else:
                        tg.start_soon(bad, c)
        # HTTP/2 clients that left mid-stream only release their streams when the connection
        # closes (httpx sends no RST_STREAM), so close both clients before checking.
        await h1.aclose()
        await h2.aclose()
        await h.engine.wait_for_async(lambda e: not e.running, timeout=30)
        with anyio.fail_after(10):
            while True:
                t = h.metrics.totals()
                if (
                    not h.client.num_unfinished
                    and t["received"] == t["rejected"] + t["finished"] + t["aborted"]
                ):
                    break
                await anyio.sleep(0.01)
    totals = h.metrics.totals()
    admitted = len(h.engine.adds())
    # A plain client may give up before its request even reached the app: the server never
    # sees it. Everything the server saw is accounted for exactly once.
    assert totals["received"] == totals["rejected"] + totals["finished"] + totals["aborted"] <= 48
    assert totals["rejected"] == tally["rejected"] == 12
    assert totals["finished"] + totals["aborted"] == admitted
    assert totals["finished"] >= tally["finished"] and totals["aborted"] > 0
    assert tally["finished"] + tally["left"] == 36
