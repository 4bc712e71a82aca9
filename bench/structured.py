"""What structured outputs cost: one `vx serve`, measured plain and under each constraint kind
in turn at each concurrency (`vx bench serve --structured json_schema|regex|tools`), the kinds
interleaved and their order reversed from one repeat to the next, so each ratio's figures are
minutes apart, not half a run.

Usage:
    python bench/structured.py [--concurrency 1,8,32] [--repeats 2] [--kinds json_schema,regex,tools]
        [--ttft-triples 12] [--vx-args '...'] [--json FILE]

Prints output tok/s (median over repeats), the ratio to the plain run (for `tools`, to
`tools_none`: the same chat requests with the tools in the prompt and no grammar), TTFT p50 and
the output tokens per request. The plain run decodes exactly --output-len tokens (ignore_eos); each
constraint of `vx bench serve --structured` cannot end before that many, so the runs compare
like for like (the last column shows it). Then, one client alone, the TTFT of streamed chat
requests (4 tokens) in interleaved triples: plain, a cached JSON schema, a schema new each time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from compare import ROOT, wait_health  # bench/ is this script's directory


def run_load(url: str, conc: int, kind: str | None, args: argparse.Namespace, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable, "-m", "vx", "bench", "serve", "--base-url", url,
        "--concurrency", str(conc), "--num-prompts", str(max(conc * 2, 8)),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--seed", str(seed), "--json", out,
    ]  # fmt: skip
    if kind is not None:
        cmd += ["--structured", kind]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    if result.get("failed"):
        raise RuntimeError(f"{kind} c={conc}: {result['failed']} failed: {result.get('errors')}")
    return result


#: The TTFT triples' schema; a new one each time gets one more property.
SCHEMA = {"type": "array", "items": {"type": "object", "required": ["name", "score"],
          "properties": {"name": {"type": "string"}, "score": {"type": "integer"}}}}  # fmt: skip


def chat_ttft_ms(client: httpx.Client, url: str, schema: dict | None) -> float:
    """Milliseconds to the first streamed content of a 4-token chat request."""
    body: dict = {"messages": [{"role": "user", "content": "List three fruits as JSON."}],
                  "max_tokens": 4, "temperature": 0, "stream": True}  # fmt: skip
    if schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema}}  # fmt: skip
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("no content streamed")


def ttft_triples(url: str, n: int) -> dict[str, float]:
    """TTFT p50 of plain, cached-schema and new-schema requests, n interleaved triples after
    a warm-up."""
    with httpx.Client(timeout=60) as client:
        for _ in range(3):
            chat_ttft_ms(client, url, None), chat_ttft_ms(client, url, SCHEMA)
        got: dict[str, list[float]] = {"plain": [], "cached": [], "new": []}
        for i in range(n):
            new = copy.deepcopy(SCHEMA)
            new["items"]["properties"][f"field_{i}"] = {"type": "string"}
            got["plain"].append(chat_ttft_ms(client, url, None))
            got["cached"].append(chat_ttft_ms(client, url, SCHEMA))
            got["new"].append(chat_ttft_ms(client, url, new))
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--kinds", default="json_schema,regex,tools_none,tools",
                   help="tools is compared with tools_none (the same chat requests, no grammar)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-triples", type=int, default=12, help="0: no TTFT triples")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--vx-args", default="", help="extra flags for the vx server")
    p.add_argument("--json", default=None, help="write all figures here")
    args = p.parse_args()
    kinds: list[str | None] = [None, *args.kinds.split(",")]
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vx", "serve", "--port", str(args.port), *args.vx_args.split()],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    runs: dict[str, dict[int, list[dict]]] = {str(k): {} for k in kinds}
    try:
        wait_health(url, proc, 300)
        for conc in map(int, args.concurrency.split(",")):
            for kind in (None, "json_schema"):  # warm: pages in, compiles
                run_load(url, conc, kind, args, seed=999)
            for rep in range(args.repeats):
                order = kinds if rep % 2 == 0 else kinds[::-1]
                for kind in order:
                    r = run_load(url, conc, kind, args, seed=1000 * conc + rep)
                    runs[str(kind)].setdefault(conc, []).append(r)
                    print(f"{kind or 'plain'} c={conc}: {r['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms", flush=True)
        triples = ttft_triples(url, args.ttft_triples) if args.ttft_triples else None
    finally:
        proc.terminate()
        proc.wait(60)
    rows = ["| kind | c | output tok/s | vs unconstrained | TTFT p50 ms | tokens/request |",
            "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for conc in runs["None"]:
        for kind in kinds:
            base_kind = "tools_none" if kind == "tools" and "tools_none" in runs else "None"
            base = statistics.median(r["output_throughput"] for r in runs[base_kind][conc])
            rs = runs[str(kind)][conc]
            tps = statistics.median(r["output_throughput"] for r in rs)
            ttft = statistics.median(r["ttft_ms"]["p50"] for r in rs)
            per = sum(r["total_output_tokens"] for r in rs) / sum(r["completed"] for r in rs)
            rows.append(f"| {kind or 'plain'} | {conc} | {tps:,.1f} | {tps / base:.3f}x "
                        f"| {ttft:.1f} | {per:.1f} |")  # fmt: skip
    print("\n".join(rows))
    if triples is not None:
        t = triples
        print(f"chat TTFT p50, {args.ttft_triples} triples: plain {t['plain']:.1f} ms, "
              f"cached schema {t['cached']:.1f} ms ({t['cached'] - t['plain']:+.1f}), "
              f"new schema {t['new']:.1f} ms ({t['new'] - t['plain']:+.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
