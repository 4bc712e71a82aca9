"""Pipeline parallel through `vx serve` and the official openai client, on a tiny random Llama
in fp32: PP = 2 and PP = 2 x TP = 2 give HF's greedy tokens (several requests at once, so the
EngineCore keeps a step per stage in flight), and a client that leaves mid-decode frees its
blocks while every stage drops its row (the requests after it still give HF's tokens). The
server's exit must leave no process or segment (`VxServer`). `vx.LLM`'s PP parity is in
test_llm.py (test_outputs_identical_across_modes).
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.e2e.server import VxServer
from tests.e2e.test_serve import metric, wait_for
from tests.models import SERVED, make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPTS = [[1, 5, 9, 13, 2, 7], list(range(3, 40)), [11] * 20 + [12, 13, 14], [4, 8, 15] * 9]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # three layers: stage 0 takes two, stage 1 one (vLLM's split); a tied head, which the
    # last stage builds from its own copy of the embedding
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", num_hidden_layers=3,
                           tie_word_embeddings=True, **SERVED)  # fmt: skip


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[str]:
    from transformers import AutoTokenizer

    from tests.e2e.test_llm import hf_greedy

    tok = AutoTokenizer.from_pretrained(tiny_model)
    # the server's text leaves special tokens out
    return [tok.decode(ids, skip_special_tokens=True)
            for ids in hf_greedy(tiny_model, PROMPTS, NEW_TOKENS)]  # fmt: skip


@pytest.fixture(scope="module", params=[["-pp", "2"], ["-pp", "2", "-tp", "2"]],
                ids=["pp2", "pp2-tp2"])  # fmt: skip
def server(tiny_model: str, request: pytest.FixtureRequest):
    args = ["--served-model-name", "tiny", "--dtype", "float32", *request.param]
    with VxServer(tiny_model, *args, "--max-num-batched-tokens", "32") as srv:
        yield srv


def _greedy_texts(url: str) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")

    def one(prompt: list[int]) -> str:
        c = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert c.usage.completion_tokens == NEW_TOKENS
        return c.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_greedy_parity_with_hf(server: VxServer, reference: list[str]) -> None:
    assert _greedy_texts(server.url) == reference
    assert "pp 1/2" in server.full_log()  # the second stage loaded its own layers


def test_abort_frees_blocks_on_every_stage(server: VxServer, reference: list[str]) -> None:
    before = metric(server.url, "vx:request_aborted_total", cause="client_disconnect")
    body = {"model": "tiny", "prompt": [3, 4, 5, 6], "max_tokens": 400, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                break  # decoding on every stage: now leave
    assert wait_for(lambda: metric(server.url, "vx:request_aborted_total",
                                   cause="client_disconnect") == before + 1)  # fmt: skip
    assert wait_for(lambda: metric(server.url, "vx:kv_cache_usage_perc") == 0.0)
    assert metric(server.url, "vx:num_requests_running") == 0
    # every stage dropped the aborted row: the next requests' steps are HF's again
    assert _greedy_texts(server.url) == reference
