"""`vx bench serve --concurrency 1,3 --plot`: several levels in one run, the comparison table,
the JSON list of runs, and the figure, redrawn later from that JSON (`--from-json`)."""

from __future__ import annotations

import json
import pathlib

import anyio
import pytest

from tests.http.conftest import running_app
from tests.http.test_http_disconnect import served
from vx.bench import serve as bench_serve
from vx.http.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

PNG = b"\x89PNG\r\n\x1a\n"


async def test_levels_json_and_plot(
    tokenizer: Tokenizer, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "runs.json", tmp_path / "runs.png"
    async with running_app(tokenizer, step_s=0.001, max_model_len=1024) as h, served(h.app) as url:
        argv = ["--base-url", url, "--concurrency", "1,3", "--input-len", "8",
                "--output-len", "6", "--min-token-id", "5", "--max-token-id", "300",
                "--json", str(out), "--plot", str(png)]  # fmt: skip
        assert await anyio.to_thread.run_sync(bench_serve.main, argv) == 0
        assert len(h.engine.adds()) == (1 + 4) + (1 + 12)  # 4 x level, one warm-up each
    runs = json.loads(out.read_text())
    assert [r["concurrency"] for r in runs] == [1, 3]
    assert [r["completed"] for r in runs] == [4, 12]
    for r in runs:
        assert len(r["samples"]["ttft_ms"]) == r["completed"]
        # 6 tokens, 5 gaps at most: the server merges tokens a slow reader has not taken yet.
        assert 0 < len(r["samples"]["itl_ms"]) <= r["completed"] * 5
        assert r["samples"]["itl_ms"] == sorted(r["samples"]["itl_ms"])
    printed = capsys.readouterr().out
    assert "concurrency    req/s" in printed and f"plot written to {png}" in printed
    assert png.read_bytes().startswith(PNG)

    again = tmp_path / "again.png"
    argv = ["--from-json", str(out), "--plot", str(again)]
    assert await anyio.to_thread.run_sync(bench_serve.main, argv) == 0
    assert again.read_bytes().startswith(PNG)


def test_bad_levels_and_old_json(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit):
        bench_serve.build_parser().parse_args(["--concurrency", "1,x"])
    args = bench_serve.build_parser().parse_args(["--concurrency", "2,8"])
    assert args.concurrency == 2 and args.concurrency_levels == [2, 8]
    assert bench_serve.build_parser().parse_args([]).concurrency == 8
    # A run saved before samples existed is drawn from its percentiles.
    pytest.importorskip("matplotlib")
    from vx.bench.plot import plot_runs

    pct = {"mean": 2.0, "p50": 2.0, "p90": 3.0, "p99": 4.0}
    old = {"concurrency": 4, "model": "m", "input_len": 1, "output_len": 2, "base_url": "u",
           "completed": 8, "failed": 0, "output_throughput": 10.0,
           "total_token_throughput": 15.0, "ttft_ms": pct, "itl_ms": pct, "tpot_ms": pct}  # fmt: skip
    plot_runs([old], str(tmp_path / "old.png"))
    assert (tmp_path / "old.png").read_bytes().startswith(PNG)
