"""Headless Chromium for the page tests: Debian's `chromium`, driven by Playwright for Python.

Runs in: the pytest process (Playwright's sync API; these tests are plain sync tests).

Set-up, once per session: /usr/bin/chromium is used as installed. When it is missing and we are
root with apt-get, the `chromium` package is installed (an `apt-get update` first if the plain
install fails); otherwise every browser test is skipped with the reason, as it is when the
`playwright` package is missing. `playwright install` is never run: Playwright only drives the
distribution's browser. Screenshots go to artifacts/browser/ (gitignored), for CI to keep.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.server import VxServer
from tests.models import SERVED, make_tiny_model

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = pathlib.Path(__file__).resolve().parents[2] / "artifacts" / "browser"


def _apt_install_chromium() -> str:
    """Install Debian's chromium; returns '' on success, else why it failed."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:  # a fresh container has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        out = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0 or not os.path.exists(CHROMIUM):
        return f"apt-get install chromium failed: {(out.stderr or out.stdout)[-300:]}"
    return ""


@pytest.fixture(scope="session")
def chromium_path() -> str:
    if not os.path.exists(CHROMIUM):
        why = _apt_install_chromium()
        if why:
            pytest.skip(f"no {CHROMIUM}: {why}")
    return CHROMIUM


# NOTE: module scope, not session: Playwright's sync API keeps an asyncio loop of its own in
# this thread while it runs, and the anyio tests of later modules could not start theirs.
@pytest.fixture(scope="module")
def browser(chromium_path: str) -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
    )
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def artifacts() -> pathlib.Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


API_KEY = "sk-browser"


@pytest.fixture(scope="module")
def tiny_server(browser: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VxServer]:
    """`vx serve --api-key` on a tiny random model whose context (8192) lets a reply run for
    seconds, served on the default path (a bf16 checkpoint, no --dtype: `SERVED`). One server
    for the whole module: its start-up is most of the module's time. On exit `VxServer` fails
    the module if a process or segment of the tree is left behind."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=8192, **SERVED)
    with VxServer(
        model, "--served-model-name", "tiny",
        "--num-gpu-blocks-override", "2048", "--api-key", API_KEY,
    ) as srv:  # fmt: skip
        yield srv


class PageErrors(list[str]):
    """Uncaught exceptions of the pages of one browser context."""


@pytest.fixture
def bare_context(browser: Any) -> Iterator[Any]:
    """A fresh browser profile: nothing in local storage (no API key yet)."""
    yield from _context(browser, with_key=False)


@pytest.fixture
def context(browser: Any) -> Iterator[Any]:
    """A browser profile whose local storage already holds the server's API key."""
    yield from _context(browser, with_key=True)


def _context(browser: Any, *, with_key: bool) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1360, "height": 860})
    if with_key:
        # Runs in every document, about:blank included (no storage there: hence the check).
        ctx.add_init_script(
            f"if (location.protocol.startsWith('http')) localStorage.setItem('vx.apiKey', '{API_KEY}')"
        )
    errors = PageErrors()
    ctx.on("page", lambda page: page.on("pageerror", lambda e: errors.append(str(e))))
    ctx.errors = errors
    try:
        yield ctx
    finally:
        ctx.close()
    assert not errors, f"uncaught errors in the page: {errors}"
