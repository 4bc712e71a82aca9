"""The app behind hypercorn on a free port: the official openai client, HTTP/2 over TLS (ALPN)
and h2c, and serve_http's readiness and shutdown."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import anyio
import httpx
import openai
import pytest

from tests.http.conftest import MODEL, REPLY, running_app
from tests.http.test_http_disconnect import served
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio


async def test_openai_client(tokenizer: Tokenizer) -> None:
    async with (
        running_app(tokenizer, step_s=0.001, api_keys=["sk-test"]) as h,
        served(h.app) as url,
    ):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
        async with client:
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]

            done = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=64)
            assert done.choices[0].text == REPLY and done.choices[0].finish_reason == "stop"
            assert done.usage is not None and done.usage.completion_tokens > 0

            chat = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=64,
                n=2,
                seed=7,
            )
            assert [c.message.content for c in chat.choices] == [REPLY, REPLY]

            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=64,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            pieces, usage, roles = [], None, []
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    roles.append(c.delta.role)
                    pieces.append(c.delta.content or "")
            assert "".join(pieces) == REPLY and roles[0] == "assistant"
            assert (
                usage is not None
                and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            )

            cstream = await client.completions.create(
                model=MODEL, prompt="Hello", max_tokens=64, stream=True
            )
            assert "".join([c.choices[0].text async for c in cstream]) == REPLY

            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(model=MODEL, prompt="Hello", max_tokens=10_000)
            assert bad.value.code == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    temperature=5,
                    stream=True,
                )
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="other", prompt="x")
        wrong = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
        async with wrong:
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()


def _self_signed(tmp_path: pathlib.Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return str(cert), str(key)


async def test_http2_over_tls_with_alpn(tokenizer: Tokenizer, tmp_path: pathlib.Path) -> None:
    cert, key = _self_signed(tmp_path)
    async with (
        running_app(tokenizer) as h,
        served(h.app, ssl_certfile=cert, ssl_keyfile=key) as url,
    ):
        https = url.replace("http://", "https://")
        async with httpx.AsyncClient(base_url=https, http2=True, verify=False) as c:
            r = await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 64})
            assert r.http_version == "HTTP/2" and r.json()["choices"][0]["text"] == REPLY
        async with httpx.AsyncClient(base_url=https, verify=False) as c:  # ALPN falls back
            r = await c.get("/health")
            assert r.http_version == "HTTP/1.1" and r.status_code == 200


async def test_h2c_prior_knowledge_and_http11_on_one_port(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, step_s=0.001) as h, served(h.app) as url:
        async with httpx.AsyncClient(base_url=url, http1=False, http2=True) as c2:
            async with anyio.create_task_group() as tg:  # concurrent streams on one connection
                results: list[str] = []

                async def one() -> None:
                    r = await c2.post(
                        "/v1/completions",
                        json={"prompt": "Hello", "max_tokens": 64, "stream": True},
                    )
                    assert r.http_version == "HTTP/2"
                    results.append(r.text)

                for _ in range(4):
                    tg.start_soon(one)
            assert all(t.endswith("data: [DONE]\n\n") for t in results) and len(results) == 4
        async with httpx.AsyncClient(base_url=url) as c1:
            assert (await c1.get("/health")).http_version == "HTTP/1.1"


async def test_h2c_upgrade(tokenizer: Tokenizer) -> None:
    """`Connection: Upgrade, HTTP2-Settings` + `Upgrade: h2c` switches the connection to h2."""
    import h2.config
    import h2.connection
    import h2.events

    async with running_app(tokenizer) as h, served(h.app) as url:
        port = int(url.rsplit(":", 1)[1])
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        settings = conn.initiate_upgrade_connection()  # already base64url
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            await sock.send(
                b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                b"Upgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n\r\n"
            )
            buf = b""
            with anyio.fail_after(5):
                while b"\r\n\r\n" not in buf:
                    buf += await sock.receive()
            head, _, rest = buf.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101")
            await sock.send(conn.data_to_send())
            status, body, ended = None, b"", False
            with anyio.fail_after(5):
                data = rest
                while not ended:
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.ResponseReceived) and event.stream_id == 1:
                            status = dict(event.headers)[b":status"]
                        elif isinstance(event, h2.events.DataReceived):
                            body += event.data
                        elif isinstance(event, h2.events.StreamEnded) and event.stream_id == 1:
                            ended = True
                    await sock.send(conn.data_to_send())
                    if not ended:
                        data = await sock.receive()
            assert status == b"200" and b'"ok"' in body


async def test_serve_http_reports_port_and_stops(tokenizer: Tokenizer) -> None:
    from vx.http.serve import serve_http

    async with running_app(tokenizer) as h:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            port = await tg.start(lambda task_status: serve_http(
                h.app, host="127.0.0.1", port=0, shutdown_trigger=stop.wait,
                graceful_timeout_s=0.5, task_status=task_status))  # fmt: skip
            assert port > 0
            async with httpx.AsyncClient() as c:
                assert (await c.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            stop.set()
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as c:
                await c.get(f"http://127.0.0.1:{port}/health")
