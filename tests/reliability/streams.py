"""Client-side stream recording for the fault goals (G4-G8): how and when each SSE stream ended.

Runs in: the pytest process (anyio, httpx).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import anyio
import httpx

from tests.reliability.harness import MODEL_NAME


@dataclass
class StreamRecord:
    """One streaming request as the client saw it."""

    status: int = 0
    events: int = 0
    first_event: anyio.Event = field(default_factory=anyio.Event)
    error: str | None = None  # the message of an error event
    done: bool = False  # saw `data: [DONE]`
    finish_reason: str | None = None
    transport_error: str | None = None
    ended_at: float | None = None  # time.monotonic()

    @property
    def clean(self) -> bool:
        """Finished normally: 200, a finish reason, [DONE], no error event."""
        return (
            self.status == 200
            and self.done
            and self.error is None
            and self.finish_reason is not None
            and self.transport_error is None
        )


async def record_stream(
    client: httpx.AsyncClient, rec: StreamRecord, max_tokens: int, prompt: str = "hello"
) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            rec.status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    rec.done = True
                    continue
                event = json.loads(line[6:])
                rec.events += 1
                rec.first_event.set()
                if "error" in event:
                    rec.error = event["error"]["message"]
                for choice in event.get("choices", ()):
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    except httpx.HTTPError as e:
        rec.transport_error = repr(e)
    finally:
        rec.ended_at = time.monotonic()
        rec.first_event.set()


async def start_streams(
    tg: anyio.abc.TaskGroup, client: httpx.AsyncClient, n: int, max_tokens: int
) -> list[StreamRecord]:
    """Start `n` streams and return once each has produced an event (or ended)."""
    records = [StreamRecord() for _ in range(n)]
    for i, rec in enumerate(records):
        tg.start_soon(record_stream, client, rec, max_tokens, f"stream {i}")
    with anyio.fail_after(120):
        for rec in records:
            await rec.first_event.wait()
    return records


def client_for(url: str, n: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    return httpx.AsyncClient(base_url=url, timeout=60, limits=limits)
