"""`vx bench serve` against the app (fake engine) behind hypercorn."""

from __future__ import annotations

import json
import pathlib

import anyio
import httpx
import pytest

from tests.http.conftest import running_app
from tests.http.test_http_disconnect import served
from vx.bench import serve as bench_serve
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio


async def test_bench_serve_ids(tokenizer: Tokenizer, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bench.json"
    async with running_app(tokenizer, step_s=0.001, max_model_len=1024) as h, served(h.app) as url:
        argv = ["--base-url", url + "/v1", "--concurrency", "4", "--num-prompts", "8",
                "--input-len", "12", "--output-len", "20", "--min-token-id", "5",
                "--max-token-id", "300", "--json", str(out)]  # fmt: skip
        rc = await anyio.to_thread.run_sync(bench_serve.main, argv)
        assert rc == 0
        adds = h.engine.adds()
        assert len(adds) == 9  # 8 + one warm-up
        assert all(len(a.prompt_token_ids) == 12 for a in adds)
        assert all(
            a.sampling_params.ignore_eos and a.sampling_params.max_tokens == 20 for a in adds
        )
        assert all(a.sampling_params.temperature == 0.0 for a in adds)
    s = json.loads(out.read_text())
    assert s["completed"] == 8 and s["failed"] == 0 and s["model"] == "tiny"
    assert s["total_output_tokens"] == 8 * 20 and s["total_input_tokens"] == 8 * 12
    assert s["output_throughput"] > 0 and s["request_throughput"] > 0
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(s[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 <= s[key]["p50"] <= s[key]["p99"]
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]


async def test_bench_serve_words_uses_server_tokenizer(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, max_model_len=1024) as h, served(h.app) as url:
        args = bench_serve.build_parser().parse_args(
            ["--base-url", url, "--concurrency", "2", "--num-prompts", "3", "--input-len", "10",
             "--output-len", "4", "--prompt-kind", "words", "--warmup", "0"]
        )  # fmt: skip
        s = await bench_serve.run(args)
        assert s["completed"] == 3 and s["total_output_tokens"] == 12
        assert all(len(a.prompt_token_ids) == 10 for a in h.engine.adds())
        assert "TTFT" in bench_serve.format_table(s)


async def test_bench_serve_reports_failures(tokenizer: Tokenizer) -> None:
    async with running_app(tokenizer, max_model_len=64) as h, served(h.app) as url:
        args = bench_serve.build_parser().parse_args(
            ["--base-url", url, "--num-prompts", "2", "--input-len", "100", "--output-len", "4",
             "--min-token-id", "5", "--max-token-id", "300", "--warmup", "0"]
        )  # fmt: skip
        s = await bench_serve.run(args)
        assert s["failed"] == 2 and "HTTP 400" in s["errors"][0]
        assert not h.engine.adds()


async def test_sse_lines_split_at_lf_only() -> None:
    """The load generator's line reader: a raw U+2028 or U+0085 inside a data line (other
    servers send them raw) stays in its line; CRLF ends are trimmed; chunk edges don't matter."""

    async def chunks():
        yield b'data: {"t": "a\xe2\x80\xa8b\xc2\x85c"}\r'
        yield b"\n\r\ndata: [DO"
        yield b"NE]\n\nlast"

    r = httpx.Response(200, content=chunks())
    lines = [line async for line in bench_serve._sse_lines(r)]
    assert lines == [b'data: {"t": "a\xe2\x80\xa8b\xc2\x85c"}', b"", b"data: [DONE]", b"", b"last"]


@pytest.mark.parametrize("kind", ["json_schema", "regex", "tools", "tools_none"])
async def test_bench_serve_structured_sends_a_constraint(tokenizer: Tokenizer, kind: str) -> None:
    async with running_app(tokenizer, max_model_len=1024) as h, served(h.app) as url:
        args = bench_serve.build_parser().parse_args(
            ["--base-url", url, "--num-prompts", "2", "--input-len", "10", "--output-len", "4",
             "--min-token-id", "5", "--max-token-id", "300", "--warmup", "0",
             "--structured", kind]
        )  # fmt: skip
        s = await bench_serve.run(args)
        assert s["completed"] == 2 and s["failed"] == 0
        for add in h.engine.adds():
            so = add.sampling_params.structured_outputs
            if kind == "tools_none":  # the baseline: no constraint, the whole length
                assert so is None and add.sampling_params.ignore_eos
                continue
            assert so is not None
            assert so.regex if kind == "regex" else so.json or so.structural_tag
            assert not add.sampling_params.ignore_eos and add.sampling_params.min_tokens == 0
