"""`vx bench serve`: a streaming load generator for OpenAI-compatible servers.

Runs in: its own process (the CLI), against vx, vLLM or llama.cpp's server alike. In the style
of `vllm bench serve`: `--num-prompts` fixed random prompts of `--input-len` tokens, each asking
for exactly `--output-len` tokens (`ignore_eos`, greedy unless `--temperature`), sent to /v1/completions with
`stream: true` by `--concurrency` clients over HTTP/1.1 (`vx.bench.client`, or httpx with
`--client httpx`). Prompts go as token-id lists by default, so every server sees the same
lengths whatever its tokenizer's whims.

Reports request and token throughput and p50/p90/p99 of TTFT (time to the first streamed
choice), ITL (gap between streamed chunks, as vLLM's bench measures it), TPOT ((e2e - ttft) /
(output tokens - 1)) and end-to-end latency, as a table and, with `--json FILE`, as JSON.

`--concurrency 1,8,32` runs one benchmark per level, in order, and adds a comparison table;
`--plot FILE.png` draws the TTFT and ITL distributions and throughput against concurrency
(`vx.bench.plot`), from this run or, with `--from-json`, from earlier runs' JSON files.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import msgspec

from vx.bench.client import HTTPStatusError, LeanClient

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        # Linear interpolation between closest ranks (numpy's default).
        k = (len(ordered) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


async def _tokenize(client: httpx.AsyncClient, text: str, model: str) -> list[int] | None:
    """Token ids from the server's own tokenizer (vx/vLLM `/tokenize`, llama.cpp `/tokenize`)."""
    for body in ({"model": model, "prompt": text, "add_special_tokens": False}, {"content": text}):
        try:
            r = await client.post("/tokenize", json=body)
        except httpx.HTTPError:
            return None
        if r.status_code == 200:
            tokens = r.json().get("tokens")
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                return tokens
    return None


def copy_prompt(rng: random.Random, words: int) -> str:
    """A copy-heavy prompt (speculative decoding's workload): a text of about `words` words
    to give back with one change, a code edit, or an extraction, in turn by `rng`."""
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    kind = rng.randrange(3)
    if kind == 0:
        w = rng.choice(_WORDS)
        return (f"Rewrite the passage below exactly as it is, but with the word '{w}' in "
                f"capitals.\n\nPassage:\n{text}\n\nRewritten passage:\n")  # fmt: skip
    if kind == 1:
        names = [rng.choice(_WORDS) for _ in range(max(words // 12, 2))]
        code = "\n\n".join(
            f"def {a}_{i}(x, y):\n    total = x + y\n    return total * {i}"
            for i, a in enumerate(names)
        )
        return f"Rename the parameter x to value in this code:\n\n{code}\n\nThe new code:\n"
    lines = "\n".join(f"- {rng.choice(_WORDS)}: {rng.randrange(1000)} units, {text[:40]}"
                      for _ in range(max(words // 16, 2)))  # fmt: skip
    return f"Extract every line of this inventory that has units:\n{lines}\n\nLines:\n"


async def make_prompts(client: httpx.AsyncClient, args: argparse.Namespace) -> list[Any]:
    """`num_prompts` distinct prompts of exactly `input_len` tokens where the server allows
    (`copy`: of about that many, as text)."""
    rng = random.Random(args.seed)
    prompts: list[Any] = []
    for _ in range(args.num_prompts):
        if args.prompt_kind == "copy":
            prompts.append(copy_prompt(rng, args.input_len * 2 // 3))
            continue
        if args.prompt_kind == "ids":
            prompts.append(
                [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(args.input_len)]
            )
            continue
        text = " ".join(rng.choice(_WORDS) for _ in range(args.input_len * 2))
        ids = await _tokenize(client, text, args.model)
        prompts.append(ids[: args.input_len] if ids and len(ids) >= args.input_len else text)
    return prompts


async def _sse_lines(r: httpx.Response) -> AsyncIterator[bytes]:
    """The lines of an event stream, split at LF (a CR before it dropped) as the SSE grammar
    says, and not at every break str.splitlines knows (httpx's `aiter_lines`), which would cut
    a data line whose JSON holds a raw U+2028 or U+0085 in two."""
    buf = b""
    async for chunk in r.aiter_bytes():
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r")
    if buf:
        yield buf.removesuffix(b"\r")


class _Events:
    """Folds one response's SSE data payloads into its RequestResult.

    Invariant: after the first error or `[DONE]`, `ended` is set and later payloads are
    ignored; `chunks` counts the payloads that carried choices."""

    def __init__(self, res: RequestResult, start: float) -> None:
        self.res, self.start, self.last = res, start, start
        self.chunks = 0
        self.ended = False

    def __call__(self, payload: bytes, now: float) -> None:
        if self.ended:
            return
        if payload == b"[DONE]":
            self.ended = True
            return
        res = self.res
        data = _DECODER.decode(payload)
        if data.get("error"):
            res.error = str(data["error"])[:200]
            self.ended = True
            return
        choices = data.get("choices")
        # a chat stream's first chunk names the role only: no token yet
        if choices and any(set(c.get("delta") or {"text": 1}) - {"role"} for c in choices):
            if self.chunks == 0:
                res.ttft_s = now - self.start
            else:
                res.itl_s.append(now - self.last)
            self.last = now
            self.chunks += 1
        usage = data.get("usage")
        if usage:
            res.output_tokens = int(usage.get("completion_tokens") or 0)
            res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)


_DECODER = msgspec.json.Decoder()


#: `--structured`: what each request's output must follow. None lets the grammar end before
#: --output-len tokens (64 array items, 64 words, 32 tool arguments at least), so each run
#: decodes as many tokens as the plain one and the runs compare like for like.
STRUCTURED: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "rows", "schema": {"type": "array", "minItems": 64, "items": {
            "type": "object", "required": ["name", "score"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 16},
                           "score": {"type": "integer"}}}}}}},
    "regex": {"structured_outputs": {"regex": "[a-z]{1,10}( [a-z]{1,10}){63,}"}},
    # a chat request (tools are chat's) whose answer must call one of two tools
    "tools": {"tool_choice": "required", "parallel_tool_calls": True, "tools": [
        {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "required": ["item", "tags"], "properties": {
                "item": {"type": "string", "maxLength": 24},
                "tags": {"type": "array", "minItems": 32,
                         "items": {"type": "string", "maxLength": 8}}}}}}
        for name in ("lookup", "note")]},
}  # fmt: skip
#: The same chat requests with `tool_choice: none` (the tools in the prompt, no grammar, exactly
#: --output-len tokens): what `tools` compares with.
STRUCTURED["tools_none"] = {**STRUCTURED["tools"], "tool_choice": "none"}


async def one_request(
    client: httpx.AsyncClient | LeanClient, args: argparse.Namespace, prompt: Any
) -> RequestResult:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "min_tokens": args.output_len,
        "ignore_eos": True,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.structured:
        if args.structured != "tools_none":
            # The grammar decides where the output may end (it ends the request there).
            del body["min_tokens"], body["ignore_eos"]
        body.update(STRUCTURED[args.structured])
    path = "/v1/completions"
    if args.structured in ("tools", "tools_none"):
        path = "/v1/chat/completions"
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": f"Look up or note each of: {text}"}]
        del body["prompt"]
    res = RequestResult(prompt_tokens=len(prompt) if isinstance(prompt, list) else 0)
    start = time.perf_counter()
    events = _Events(res, start)
    try:
        if isinstance(client, LeanClient):
            await client.stream_post(path, msgspec.json.encode(body), events, args.timeout)
        else:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in _sse_lines(r):
                    if line.startswith(b"data:"):
                        events(line[5:].strip(), time.perf_counter())
                    if events.ended:
                        break
    except (
        httpx.HTTPError, HTTPStatusError, OSError, TimeoutError, ValueError, msgspec.DecodeError
    ) as e:  # fmt: skip
        res.error = f"{type(e).__name__}: {e}" if not isinstance(e, HTTPStatusError) else str(e)
        return res
    if res.error:
        return res
    res.e2e_s = time.perf_counter() - start
    if res.output_tokens == 0:
        res.output_tokens = events.chunks  # a server without usage in streams: one per chunk
    res.ok = events.chunks > 0
    if not res.ok:
        res.error = "no streamed output"
    return res


async def run(args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(
        max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4
    )
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=httpx.Timeout(args.timeout), limits=limits, headers=headers
    ) as client:
        if args.model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            args.model = r.json()["data"][0]["id"]
        prompts = await make_prompts(client, args)
        for prompt in prompts[: args.warmup]:
            warm = await one_request(client, args, prompt)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        results: list[RequestResult] = []
        queue = list(reversed(prompts))
        streamer: httpx.AsyncClient | LeanClient = client
        if args.client == "lean" and args.base_url.startswith("http://"):
            streamer = LeanClient(args.base_url, headers)

        async def worker() -> None:
            while queue:
                results.append(await one_request(streamer, args, queue.pop()))

        start = time.perf_counter()
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(min(args.concurrency, len(prompts))):
                    tg.start_soon(worker)
        finally:
            if isinstance(streamer, LeanClient):
                streamer.close()
        duration = time.perf_counter() - start
    return summarize(args, results, duration)


def summarize(
    args: argparse.Namespace, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    ms = 1000.0
    ttft = [r.ttft_s * ms for r in ok]
    itl = [x * ms for r in ok for x in r.itl_s]
    return {
        "base_url": args.base_url,
        "model": args.model,
        "concurrency": args.concurrency,
        "num_prompts": len(results),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (output + prompt) / duration if duration else 0.0,
        "total_output_tokens": output,
        "total_input_tokens": prompt,
        "ttft_ms": {k: v * ms for k, v in _percentiles([r.ttft_s for r in ok]).items()},
        "itl_ms": {k: v * ms for k, v in _percentiles([x for r in ok for x in r.itl_s]).items()},
        "tpot_ms": {k: v * ms for k, v in _percentiles(tpot).items()},
        "e2e_ms": {k: v * ms for k, v in _percentiles([r.e2e_s for r in ok]).items()},
        # Quantiles of the raw latencies (ms), enough to redraw their distributions later.
        "samples": {"ttft_ms": _quantile_sample(ttft), "itl_ms": _quantile_sample(itl)},
    }


def _quantile_sample(values: list[float], k: int = 1000) -> list[float]:
    """At most `k` evenly spaced order statistics of `values`: the same distribution, smaller."""
    ordered = sorted(values)
    if len(ordered) > k:
        ordered = [ordered[round(i * (len(ordered) - 1) / (k - 1))] for i in range(k)]
    return [round(v, 3) for v in ordered]


def format_comparison(runs: list[dict[str, Any]]) -> str:
    """One line per run: the figures that move with concurrency."""
    lines = [
        f"{'concurrency':>11}{'req/s':>9}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}  (ms)"
    ]
    for s in runs:
        lines.append(
            f"{s['concurrency']:>11}{s['request_throughput']:>9.2f}{s['output_throughput']:>11.1f}"
            f"{s['ttft_ms']['p50']:>10.1f}{s['ttft_ms']['p99']:>10.1f}{s['itl_ms']['p50']:>9.2f}"
            f"{s['itl_ms']['p99']:>9.2f}{s['tpot_ms']['p50']:>10.2f}"
        )
    return "\n".join(lines)


def load_runs(path: str) -> list[dict[str, Any]]:
    """The runs in a `--json` file: one run (a dict) or several (a list)."""
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


class _ConcurrencyLevels(argparse.Action):
    """`--concurrency 8` or `--concurrency 1,8,32`: `concurrency` gets the first level (what
    `run` uses) and `concurrency_levels` all of them."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        try:
            levels = [int(v) for v in str(values).split(",") if v.strip()]
        except ValueError:
            parser.error(f"--concurrency: expected integers like 8 or 1,8,32, got {values!r}")
        if not levels:
            parser.error("--concurrency: no level given")
        namespace.concurrency = levels[0]
        namespace.concurrency_levels = levels


def format_table(s: dict[str, Any]) -> str:
    lines = [
        f"{'server':<24}{s['base_url']}  model {s['model']}",
        f"{'workload':<24}{s['num_prompts']} prompts x ({s['input_len']} in, {s['output_len']} out), "
        f"concurrency {s['concurrency']}",
        f"{'completed / failed':<24}{s['completed']} / {s['failed']}",
        f"{'duration':<24}{s['duration_s']:.2f} s",
        f"{'request throughput':<24}{s['request_throughput']:.2f} req/s",
        f"{'output throughput':<24}{s['output_throughput']:.1f} tok/s",
        f"{'total throughput':<24}{s['total_token_throughput']:.1f} tok/s",
        f"{'':<24}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, label in (
        ("ttft_ms", "TTFT (ms)"),
        ("itl_ms", "ITL (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("e2e_ms", "E2E (ms)"),
    ):
        v = s[key]
        lines.append(
            f"{label:<24}{v['mean']:>10.1f}{v['p50']:>10.1f}{v['p90']:>10.1f}{v['p99']:>10.1f}"
        )
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vx bench serve", description=__doc__.split("\n\n")[1] if __doc__ else None
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--concurrency", action=_ConcurrencyLevels, default=8,
                   help="clients in flight; several levels run in turn: 1,8,32")  # fmt: skip
    p.set_defaults(concurrency_levels=None)
    p.add_argument("--num-prompts", type=int, default=None, help="default: 4 x concurrency")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-kind", choices=["ids", "words", "copy"], default="ids",
                   help="ids: random token ids; words: random words, tokenized by the server; "
                        "copy: copy-heavy text (rewrite with one change, code edit, "
                        "extraction), speculative decoding's workload")  # fmt: skip
    p.add_argument("--min-token-id", type=int, default=1000)
    p.add_argument("--max-token-id", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy; above it the output is text no "
                        "n-gram predicts, speculative decoding's worst case)")  # fmt: skip
    p.add_argument("--structured", choices=sorted(STRUCTURED), default=None,
                   help="every request's output follows a JSON schema or a regex (compare "
                        "with a run without it; outputs may end before --output-len)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--api-key", default=None)
    p.add_argument("--client", choices=["lean", "httpx"], default="lean",
                   help="the streaming requests' client: lean (vx.bench.client, an asyncio "
                   "protocol per connection, least CPU per token; plain http only, https "
                   "goes through httpx) or httpx")  # fmt: skip
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw TTFT/ITL distributions and throughput vs concurrency")  # fmt: skip
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="no load: report (and --plot) the runs saved in these --json files")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    levels = args.concurrency_levels or [args.concurrency]
    if args.from_json:
        try:
            runs = [run for path in args.from_json for run in load_runs(path)]
        except (OSError, ValueError) as e:
            sys.stderr.write(f"vx bench serve: {e}\n")
            return 2
    else:
        runs = []
        num_prompts = 1 if args.num_prompts is None else args.num_prompts
        if min(*levels, num_prompts, args.input_len, args.output_len) < 1:
            sys.stderr.write(
                "concurrency, num-prompts, input-len and output-len must be positive\n"
            )
            return 2
        args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
        for level in levels:
            level_args = copy.copy(args)
            level_args.concurrency = level
            level_args.num_prompts = args.num_prompts or 4 * level
            try:
                summary = anyio.run(run, level_args)
            except (httpx.HTTPError, RuntimeError, KeyError) as e:
                sys.stderr.write(f"vx bench serve: {type(e).__name__}: {e}\n")
                return 1
            args.model = summary["model"]  # the later levels skip the discovery
            sys.stdout.write(format_table(summary) + "\n")
            runs.append(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(runs[0] if len(runs) == 1 else runs, f, indent=1)
    if len(runs) > 1:
        sys.stdout.write(format_comparison(runs) + "\n")
    if args.plot:
        from vx.bench.plot import plot_runs

        plot_runs(runs, args.plot)
        sys.stdout.write(f"plot written to {args.plot}\n")
    return 0 if all(s["failed"] == 0 for s in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
