"""What an operator reads (issue 54): request ids, JSON log lines, the access log, /load.

Two real `vx serve` trees on the tiny model: one with `--log-format json
--enable-log-requests`, one with the defaults (text lines, no request lines, no prompts) and
`--disable-access-log`.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.server import VxServer
from tests.models import SERVED, make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPT = "The secret prompt words"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 8,192 positions: a stream long enough to still run while a second request arrives.
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-ops"), arch="llama", max_position_embeddings=8192, **SERVED
    )


def _complete(url: str, request_id: str | None, stream: bool) -> httpx.Response:
    headers = {"x-request-id": request_id} if request_id else {}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_json_logs_carry_the_request_id_in_every_process(model: str) -> None:
    with VxServer(model, "--served-model-name", "tiny", "--log-format", "json",
                  "--enable-log-requests") as server:  # fmt: skip
        r = _complete(server.url, "client-id-42", stream=False)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "client-id-42"
        assert r.json()["id"] == "cmpl-client-id-42"
        s = _complete(server.url, "client-id-43", stream=True)
        assert s.status_code == 200 and s.headers["x-request-id"] == "client-id-43"
        events = [json.loads(line[6:]) for line in s.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert events and all(e["id"] == "cmpl-client-id-43" for e in events)
        # No id sent: one is made, echoed, and used.
        g = _complete(server.url, None, stream=False)
        assert g.json()["id"] == "cmpl-" + g.headers["x-request-id"]
        # A duplicate in flight is refused (409), and the first goes on; a bad id is replaced.
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                          headers={"x-request-id": "twice"}) as first:  # fmt: skip
            lines = first.iter_lines()  # one iterator: a dropped one closes the stream
            assert next(lines).startswith("data: ")
            load = httpx.get(server.url + "/load", timeout=10).json()
            assert load["in_flight"] == 1 and load["running"] + load["waiting"] == 1, load
            dup = _complete(server.url, "twice", stream=False)
            assert dup.status_code == 409, dup.text
            assert dup.json()["error"]["code"] == "duplicate_request_id"
            assert "data: [DONE]" in list(lines)
        bad = _complete(server.url, "has spaces\tand tabs", stream=False)
        assert bad.status_code == 200 and bad.headers["x-request-id"] != "has spaces\tand tabs"
        load = httpx.get(server.url + "/load", timeout=10).json()
        assert load["ready"] is True and load["in_flight"] == 0
        assert load["running"] == 0 and load["waiting"] == 0 and len(load["engines"]) == 1
    lines = [json.loads(line) for line in server.full_log().splitlines() if line.strip()]
    # Every line of every process parsed, and has the fields.
    assert lines
    for obj in lines:
        assert {"time", "level", "role", "pid", "request_id", "message"} <= obj.keys(), obj
    roles = {obj["role"] for obj in lines}
    assert {"api", "engine0", "worker0"} <= roles, roles

    def about(rid: str, role: str) -> list[str]:
        # The front tags its lines with the HTTP request's id itself; the EngineCore with the
        # engine request ids made from it (cmpl-<id>-<choice>).
        if role == "api":
            return [o["message"] for o in lines if o["role"] == role and o["request_id"] == rid]
        return [o["message"] for o in lines if o["role"] == role
                and o["request_id"] == f"cmpl-{rid}-0"]  # fmt: skip

    front = about("client-id-42", "api")
    engine = about("client-id-42", "engine0")
    assert any("admitted" in m for m in front) and any("finished" in m for m in front), front
    assert any("access" in o["logger"] and o["request_id"] == "client-id-42" for o in lines)
    assert any("admitted" in m for m in engine) and any("finished" in m for m in engine), engine
    assert any("first token" in m for m in about("client-id-43", "api"))
    # With --enable-log-requests the prompt is logged (in the front only).
    assert any(PROMPT in m for m in front)
    access = [o["message"] for o in lines if o["logger"] == "vx.access"
              and o["request_id"] == "client-id-42"]  # fmt: skip
    assert len(access) == 1 and '"POST /v1/completions" 200' in access[0], access
    assert "prompt_tokens=" in access[0] and "output_tokens=5" in access[0], access
    assert "ttft_ms=" in access[0] and "total_ms=" in access[0], access


def test_default_logs_keep_prompts_out_and_access_log_can_be_off(model: str) -> None:
    with VxServer(model, "--served-model-name", "tiny", "--disable-access-log") as server:
        r = _complete(server.url, "quiet-1", stream=False)
        assert r.status_code == 200 and r.headers["x-request-id"] == "quiet-1"
    log = server.full_log()
    assert PROMPT not in log
    assert "vx.access" not in log
    assert "request cmpl-quiet-1" not in log  # request lines are DEBUG without the flag
