"""The chat page and the dashboard in headless Chromium, against a real `vx serve`.

A prompt streams an answer with its TTFT, speed and finish reason; Stop aborts the request (the
server sees the disconnect) and the dashboard, live while the reply streams, shows the running
request and then the KV pool back at zero. Screenshots land in artifacts/browser/.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import httpx
import pytest

from tests.browser.conftest import API_KEY
from tests.e2e.server import VxServer

# Generous timeout: the first test of a session may install chromium (see conftest.py).
pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.timeout(900)]

WAIT_MS = 20_000


def aborted_total(url: str) -> float:
    auth = {"authorization": f"Bearer {API_KEY}"}
    text = httpx.get(url + "/metrics", headers=auth, timeout=5).text
    m = re.search(r'^vx:request_aborted_total\{cause="client_disconnect".*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def open_chat(context: Any, url: str, *, max_tokens: int, ignore_eos: bool) -> Any:
    page = context.new_page()
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#seed", "7")
    if ignore_eos:
        page.check("#ignore_eos")
    return page


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_chat_streams_an_answer(
    context: Any, tiny_server: VxServer, artifacts: pathlib.Path
) -> None:
    page = open_chat(context, tiny_server.url, max_tokens=24, ignore_eos=True)
    page.screenshot(path=str(artifacts / "chat-empty.png"))
    send(page, "What is the capital of France?")
    done = page.wait_for_selector(".msg.assistant[data-state=done]", timeout=WAIT_MS)
    assert done.get_attribute("data-finish") == "length"
    assert done.get_attribute("data-tokens") == "24"
    assert done.inner_text().strip()
    chips = done.eval_on_selector_all(".chip", "els => els.map(e => e.textContent)")
    assert any(c.startswith("TTFT") and c.endswith("ms") for c in chips), chips
    assert any(c.startswith("speed") and c.endswith("tok/s") for c in chips), chips
    assert "finish length" in chips
    assert page.is_hidden("#stop") and page.is_enabled("#send")
    page.screenshot(path=str(artifacts / "chat.png"))


def test_stop_aborts_and_the_dashboard_follows(
    context: Any, tiny_server: VxServer, artifacts: pathlib.Path
) -> None:
    url = tiny_server.url
    before = aborted_total(url)
    dash = context.new_page()
    dash.goto(url + "/dashboard")
    dash.wait_for_function("document.getElementById('conn-text').textContent === 'live'")
    chat = open_chat(context, url, max_tokens=8000, ignore_eos=True)
    send(chat, "Tell me a very long story.")
    chat.wait_for_selector(".msg.assistant[data-state=streaming]", timeout=WAIT_MS)
    chat.wait_for_function(
        "document.querySelector('.msg.assistant .bubble').textContent.length > 0",
        timeout=WAIT_MS,
    )
    # The dashboard shows the streaming request: running 1, blocks in use on the map.
    dash.wait_for_selector("#kpi-running[data-value='1']", timeout=WAIT_MS)
    dash.wait_for_function(
        "Number(document.querySelector('canvas.blockmap').dataset.used) > 0", timeout=WAIT_MS
    )
    dash.screenshot(path=str(artifacts / "dashboard-busy.png"))
    chat.screenshot(path=str(artifacts / "chat-streaming.png"))

    chat.click("#stop")
    stopped = chat.wait_for_selector(".msg.assistant[data-state=aborted]", timeout=WAIT_MS)
    assert stopped.get_attribute("data-finish") == "abort"
    tokens = int(stopped.get_attribute("data-tokens"))
    assert 0 < tokens < 8000
    # The server saw the disconnect and aborted; the dashboard shows the pool back at zero.
    dash.wait_for_selector("#kpi-kv[data-value='0']", timeout=WAIT_MS)
    dash.wait_for_selector("#kpi-running[data-value='0']", timeout=WAIT_MS)
    dash.wait_for_function(
        "document.querySelector('canvas.blockmap').dataset.used === '0'", timeout=WAIT_MS
    )
    dash.wait_for_selector(".events .tag.abort", timeout=WAIT_MS)
    assert "client disconnect" in dash.inner_text(".events")
    assert aborted_total(url) == before + 1
    dash.screenshot(path=str(artifacts / "dashboard-after-stop.png"))
    chat.screenshot(path=str(artifacts / "chat-stopped.png"))
    # The dashboard's feed must not hold the server's shutdown: close it before the server.
    dash.close()


def test_api_key_typed_into_the_page(bare_context: Any, tiny_server: VxServer) -> None:
    url = tiny_server.url
    page = bare_context.new_page()
    page.goto(url + "/")  # the page itself is public; the API is not
    page.wait_for_function("document.getElementById('health-text').textContent.includes('key')")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
    page.fill("#max_tokens", "8")
    page.check("#ignore_eos")
    send(page, "hello")
    done = page.wait_for_selector(".msg.assistant[data-state=done]", timeout=WAIT_MS)
    assert done.get_attribute("data-finish") == "length"
    # The dashboard reads the key the chat page stored, and its feed then goes live.
    dash = bare_context.new_page()
    dash.goto(url + "/dashboard")
    dash.wait_for_function("document.getElementById('conn-text').textContent === 'live'")
    dash.wait_for_selector("#kpi-running[data-value='0']", timeout=WAIT_MS)
    dash.close()
    assert httpx.get(url + "/v1/engine/events", timeout=5).status_code == 401


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 8}}}}}]  # fmt: skip


def test_json_mode_and_tool_call_cards(
    context: Any, tiny_server: VxServer, artifacts: pathlib.Path
) -> None:
    """The JSON-mode switch makes the reply a JSON object; tools with tool_choice `required`
    show the call the model made as a card: its function's name and its arguments."""
    page = open_chat(context, tiny_server.url, max_tokens=600, ignore_eos=False)
    page.check("#json_mode")
    send(page, "Describe Paris as JSON.")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=WAIT_MS)
    reply = page.locator(".msg.assistant").nth(0)
    text = reply.locator(".bubble").inner_text()
    assert text.lstrip().startswith("{"), text
    if reply.get_attribute("data-finish") == "stop":
        assert isinstance(json.loads(text), dict)
    page.uncheck("#json_mode")
    page.fill("#tools", json.dumps(WEATHER))
    page.select_option("#tool_choice", "required")
    send(page, "What is the weather in Paris?")
    page.wait_for_function(
        "document.querySelectorAll('.msg.assistant[data-state=done]').length === 2",
        timeout=WAIT_MS,
    )
    reply = page.locator(".msg.assistant").nth(1)
    # the random model may go on calling (parallel calls) until max_tokens
    assert reply.get_attribute("data-finish") in ("tool_calls", "length")
    cards = reply.locator(".tool-card")
    assert cards.count() >= 1
    for i in range(cards.count()):
        assert cards.nth(i).locator(".tool-name").inner_text().endswith("get_weather")
    args = json.loads(cards.first.locator(".tool-args").inner_text())  # a finished call
    assert set(args) == {"city"} and len(args["city"]) <= 8
    page.screenshot(path=str(artifacts / "chat-tools.png"))
