"""Fixtures for the front's tests: a tiny tokenizer directory and a running app on a fake engine.

Runs in: the pytest process. The tokenizer is a byte-level BPE trained here (nothing is
downloaded) on text with multi-byte characters, so some characters span several tokens.
`running_app(...)` starts a FakeEngine thread on real rings, an EngineClient in a task group,
and `build_app`, and yields a `Harness`; leaving it stops everything and closes the rings.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest

from tests.http.fake_engine import FakeEngine
from vx.http.app import build_app
from vx.http.engine_client import EngineClient
from vx.http.tokenizer import Tokenizer, load_tokenizer

CORPUS = [
    "Hello world! This is a tiny tokenizer for the vx front.",
    "one two three four five six seven eight nine ten",
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln, café crème, naïve façade.",
    "日本語のテキストも少し。",
    "Emoji: 😀 🎉 👍",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: What the fake engine says, token by token (then EOS).
REPLY = "Hello wörld! 😀 one two three four five"
MODEL = "tiny"


def write_tokenizer_dir(path: pathlib.Path) -> pathlib.Path:
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: pathlib.Path) -> Tokenizer:
    return load_tokenizer(tokenizer_dir)


@dataclass
class Harness:
    engine: FakeEngine
    client: EngineClient
    app: Any
    tokenizer: Tokenizer

    def http(self, **kwargs: Any) -> httpx.AsyncClient:
        """An in-process client (the ASGI transport buffers each response whole)."""
        transport = httpx.ASGITransport(app=self.app)
        return httpx.AsyncClient(transport=transport, base_url="http://test", **kwargs)

    @property
    def metrics(self) -> Any:
        return self.app.state.vx.metrics


@contextlib.asynccontextmanager
async def running_app(
    tokenizer: Tokenizer,
    *,
    step_s: float = 0.0,
    max_model_len: int = 256,
    reply: str = REPLY,
    num_engines: int = 1,
    worker_pids: list[list[int]] | None = None,
    **app_kwargs: Any,
) -> AsyncIterator[Harness]:
    """`worker_pids[i]`: what engine i's EngineReady reports (none by default)."""
    reply_ids = tokenizer.encode(reply, add_special_tokens=False)
    engines = [
        FakeEngine(
            reply_ids, eos_token_id=tokenizer.eos_token_id, engine_index=i,
            max_model_len=max_model_len, step_s=step_s,
            worker_pids=worker_pids[i] if worker_pids else None,
        ).start()
        for i in range(num_engines)
    ]  # fmt: skip
    try:
        client = EngineClient([e.rings for e in engines])
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(10):
                await tg.start(client.run)
            app = build_app(client, served_model_name=MODEL, tokenizer=tokenizer, **app_kwargs)
            harness = Harness(engines[0], client, app, tokenizer)
            harness.engines = engines  # type: ignore[attr-defined]
            try:
                yield harness
            finally:
                tg.cancel_scope.cancel()
    finally:
        for e in engines:
            e.stop()
