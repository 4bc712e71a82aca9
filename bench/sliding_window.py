"""Serve long contexts on sliding-window models: the KV blocks a request holds against what its
windows need, and decode speed at two context lengths past the window.

Usage (under the exclusive benchmark lock; a few minutes on 2 cores):

    flock -x /work/coord/cpu.lock .venv/bin/python bench/sliding_window.py [--ctx 2048,8192]
        [--decode 128] [--shapes gemma2,gemma3,mistral] [--threads 2]

Models: tiny random checkpoints (tests.models.make_tiny_model, bf16, head_dim 64, 8 query
and 4 KV heads, hidden 256) of three layouts:
- gemma2: 4 layers, sliding and global alternating, window 4096, attention soft-cap 50;
- gemma3: 6 layers, 5 sliding then 1 global, window 512, Gemma 3's two rope bases;
- mistral: 4 layers, every one windowed (512): one KV-cache group, freed alike.

Each runs as `vx serve` (real processes, HTTP); per context length, one request of that many
random prompt tokens streams `--decode` tokens (greedy, ignore_eos), `--repeats` times (a
token more each time, so no prefix hit: the median is shown). Decode tok/s is the
tokens after the first (the usage count: an event carries every token the server has when it
writes it) over the time from the first event to the last (the whole model: its global layers'
attention grows with the context); the blocks held are read from /metrics
(`vx:kv_cache_usage_perc` x the pool) every 10 ms while a request of its own decodes, alone on
the server (polling beside the timed requests took a share of the cores from them).
"What the windows need", per layer kind, in blocks of 16 tokens: a global layer the whole
context, a windowed one ceil((W - 1) / 16) + 1; the table gives both as blocks of all layers.
Gemma's layers fall in KV-cache groups (`vx.gpu.kv_cache.kv_cache_groups`: a pool block is
one layer's K/V in each of `group_size` tensors), so the pool is sized and read in its own
blocks (the same memory as `nb` blocks of all layers) and the held count converted: pool
blocks held x group_size / layers.

Before the servers, one layer's decode attention alone (`WindowedAttention` on the C kernels,
one request, this process, `--threads` threads): a windowed layer and a global one at each
context length, microseconds a call.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.e2e.server import VxServer
from tests.models import make_tiny_model
from vx.gpu.kv_cache import kv_cache_groups

BS = 16
COMMON = {"dtype": "bfloat16", "hidden_size": 256, "intermediate_size": 512,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "max_position_embeddings": 16384}  # fmt: skip
SHAPES = {
    "gemma2": ("gemma2", 4096, {
        "num_hidden_layers": 4, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "sliding_window": 4096,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }),
    "gemma3": ("gemma3", 512, {
        "num_hidden_layers": 6, "query_pre_attn_scalar": 64, "sliding_window": 512,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    }),
    "mistral": ("mistral", 512, {"num_hidden_layers": 4, "sliding_window": 512}),
}  # fmt: skip


def _usage(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^vx:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def _one(url: str, model: str, ctx: int, decode: int, vocab: int, poll: bool) -> tuple[float, float]:
    """(decode tok/s, highest KV usage seen while it decoded, with `poll`) for one request of
    ctx tokens."""
    rng = random.Random(ctx)
    prompt = [rng.randrange(3, vocab) for _ in range(ctx)]
    body = {"model": model, "prompt": prompt, "max_tokens": decode, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    times: list[float] = []
    peak = [0.0]
    done = threading.Event()

    def poll() -> None:
        while poll and not done.wait(0.01):  # sampling another process's gauge, not a sync
            if times:
                peak[0] = max(peak[0], _usage(url))

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif event["choices"][0].get("text") is not None:
                        times.append(time.perf_counter())
    finally:
        done.set()
        poller.join()
    # tokens, not events: an event carries every token the server has when it writes
    return (tokens - 1) / (times[-1] - times[0]), peak[0]


def _layer_us(ctx: int, window: int | None, threads: int) -> float:
    """One decode row's attention over ctx keys in one layer (8 query, 4 KV heads, D 64, bf16),
    microseconds a call (median of 5 runs of 50)."""
    import numpy as np
    import torch

    from vx.gpu.attention.paged import build_attention_metadata
    from vx.gpu.attention.windowed import WindowedAttention
    from vx.gpu.kv_cache import allocate_kv_caches

    torch.set_num_threads(threads)
    nb = -(-ctx // BS) + 1
    (kc, vc) = allocate_kv_caches(1, nb, 4, 64, dtype=torch.bfloat16, device="cpu")[0]
    kc.normal_()
    vc.normal_()
    md = build_attention_metadata(
        query_lens=np.array([1]), num_computed=np.array([ctx - 1]),
        block_table=np.arange(nb, dtype=np.int32)[None], slot_mapping=np.array([ctx - 1]),
        num_decodes=1,
    )  # fmt: skip
    q, k = torch.randn(1, 8, 64).bfloat16(), torch.randn(1, 4, 64).bfloat16()
    attn = WindowedAttention(window, None)
    runs = []
    with torch.inference_mode():
        for _ in range(6):
            t = time.perf_counter()
            for _ in range(50):
                attn(q, k, k, (kc, vc), md, 0.125)
            runs.append((time.perf_counter() - t) / 50 * 1e6)
    return statistics.median(runs[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ctx", default="2048,8192")
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--shapes", default="gemma2,gemma3,mistral")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="requests per context (median)")
    a = p.parse_args()
    ctxs = [int(c) for c in a.ctx.split(",")]
    print("| one layer's decode attention | " + " | ".join(f"{c} keys" for c in ctxs) + " |")
    print("|---|" + "---:|" * len(ctxs))
    for label, w in (("window 512", 512), ("window 4096", 4096), ("global", None)):
        us = [_layer_us(c, w, a.threads) for c in ctxs]
        print(f"| {label} | " + " | ".join(f"{u:.0f} us" for u in us) + " |")
    print()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.shapes.split(","):
            arch, window, over = SHAPES[name]
            path = make_tiny_model(tmp, arch, seed=1, **{**COMMON, **over})
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
            types = cfg.get("layer_types") or ["sliding_attention"] * cfg["num_hidden_layers"]
            n_win = sum(t == "sliding_attention" for t in types)
            n_all = len(types)
            groups = kv_cache_groups([window if t == "sliding_attention" else None for t in types])
            nb_all = 2 * (max(ctxs) + a.decode) // BS + 64  # in blocks of every layer
            nb = nb_all * n_all // groups.group_size  # the pool's own blocks, same memory
            with VxServer(path, "--num-gpu-blocks-override", str(nb), "--max-model-len",
                          str(max(ctxs) + a.decode + 16), "--max-num-seqs", "4",
                          "--num-threads", str(a.threads)) as srv:  # fmt: skip
                for ctx in ctxs:
                    _one(srv.url, path, 256, 4, cfg["vocab_size"], poll=False)  # warm-up
                    # the blocks from a request of their own: polling the gauge every 10 ms
                    # takes a share of the two cores from the decode whose speed is measured
                    _, usage = _one(srv.url, path, ctx, a.decode, cfg["vocab_size"], poll=True)
                    runs = [_one(srv.url, path, ctx + 1 + i, a.decode, cfg["vocab_size"],
                                 poll=False) for i in range(a.repeats)]  # fmt: skip
                    tps = statistics.median(r[0] for r in runs)
                    held = usage * nb * groups.group_size / n_all
                    end = ctx + a.decode
                    win_need = -(-(window - 1) // BS) + 1
                    need = (n_win * min(win_need, -(-end // BS)) + (n_all - n_win) * -(-end // BS))
                    rows.append((name, window, ctx, tps, held, need / n_all, -(-end // BS)))
    print("| model | window | context | decode tok/s | KV blocks held | blocks the windows "
          "need (all-layer blocks) | whole context |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, w, ctx, tps, held, need, whole in rows:
        print(f"| {name} | {w} | {ctx} | {tps:.1f} | {held:.0f} | {need:.0f} | {whole} |")


if __name__ == "__main__":
    main()
