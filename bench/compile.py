"""The torch.compile lever: inductor on CPU against vx's step, in the same run.

Usage (always under the shared benchmark lock):

    flock /tmp/vx-bench.lock .venv/bin/python bench/compile.py [--threads 2] [--repeats 5]
        [--mode default|max-autotune-no-cudagraphs] [--no-freezing] [--random]
        [--cases 1,16,64,p128]

What it asks: would compiling a Llama's torch modules with inductor (static shapes, one graph
per batch bucket) beat the step vx serves? The compiled side is HF transformers' Llama, the
documented recipe for it: a `StaticCache` (fixed shapes, K/V written in place), then
`torch.compile(model.forward, fullgraph=True, dynamic=False)`, one compiled graph per case (a
batch bucket), with inductor's `freezing` (weights folded in as constants, linears prepacked
for oneDNN) unless `--no-freezing`. It is the whole model in one graph: the same ops vx's
module path would hand inductor (norms, linears, rotary, SDPA, SiLU-mul), without vx's C
kernels or its paged cache, which inductor cannot see into.

Cases: decode steps of 1, 16 and 64 rows with 256 tokens of K/V each (`1`, `16`, `64`) and a
prefill of 128 tokens (`p128`), as in `bench/forward.py`. Per case, interleaved step by step:
vx's ModelRunner step (as served: whatever the Worker would run), HF eager (its default
`DynamicCache` and SDPA) and HF compiled. The first compiled call of a case (the compile) is
untimed and reported on its own. Printed: medians in ms, compiled / eager and vx / compiled.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch._dynamo
import torch._inductor.config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.forward import KV_LEN, Driver, model_path, prompt_of
from bench.step_profile import build_runner
from vx.config import BLOCK_SIZE


def hf_step(hf, ids: torch.Tensor, cache, start: int) -> torch.Tensor:
    """One HF forward (eager, or `torch.compile`d) of `ids` [B, n] at positions start ..
    start + n - 1: the last position's logits [B, 1, vocab]."""
    b, n = ids.shape
    pos = torch.arange(start, start + n)
    return hf(ids, past_key_values=cache, use_cache=True, cache_position=pos,
       position_ids=pos.expand(b, n), logits_to_keep=1).logits  # fmt: skip


def filled_static_cache(hf, ids: torch.Tensor, max_len: int, *, reset: bool):
    """A `StaticCache` whose tensors one eager forward of `ids` allocated, so that a compiled
    graph finds them and never allocates them itself: holding `ids`' K/V (decode on from
    position len(ids)), or `reset` (the cache counts what it holds: a prompt from position 0
    needs it empty)."""
    from transformers import StaticCache

    cache = StaticCache(config=hf.config, max_cache_len=max_len)
    hf_step(hf, ids, cache, 0)
    if reset:
        cache.reset()
    return cache


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_decode(driver: Driver, hf, compiled, batch: int, repeats: int) -> dict[str, list]:
    from transformers import DynamicCache

    ids = [f"d{batch}-{i}" for i in range(batch)]
    prompts = [prompt_of(KV_LEN, i) for i in range(batch)]
    new = [driver.add(r, p, KV_LEN + repeats + 2) for r, p in zip(ids, prompts, strict=True)]
    per_step = max(1, 2048 // KV_LEN)
    for i in range(0, batch, per_step):  # vx's prompts: untimed
        driver.step(new[i : i + per_step], {r: KV_LEN for r in ids[i : i + per_step]})
    times: dict[str, list] = {"vx": [], "eager": [], "compiled": [], "compile": []}
    with torch.inference_mode():
        dyn = DynamicCache()
        hf_step(hf, torch.tensor(prompts), dyn, 0)
        # the prompts eagerly: the compiled graph decodes only
        static = filled_static_cache(hf, torch.tensor(prompts), KV_LEN + 32, reset=False)
        tok = torch.randint(100, 40000, (batch, 1))
        times["compile"].append(_timed(lambda: hf_step(compiled, tok, static, KV_LEN)))
        for i in range(repeats + 1):
            vx = driver.step([], dict.fromkeys(ids, 1))
            eager = _timed(lambda i=i: hf_step(hf, tok, dyn, KV_LEN + i))
            comp = _timed(lambda i=i: hf_step(compiled, tok, static, KV_LEN + 1 + i))
            if i:  # the first round warms every side up
                times["vx"].append(vx)
                times["eager"].append(eager)
                times["compiled"].append(comp)
    driver.finish(ids)
    return times


def bench_prefill(driver: Driver, hf, compiled, n: int, repeats: int) -> dict[str, list]:
    from transformers import DynamicCache

    times: dict[str, list] = {"vx": [], "eager": [], "compiled": [], "compile": []}
    with torch.inference_mode():
        warm = torch.tensor([prompt_of(n, 999)])
        static = filled_static_cache(hf, warm, n + 16, reset=True)
        times["compile"].append(_timed(lambda: hf_step(compiled, warm, static, 0)))
        for rep in range(repeats + 1):
            rid, prompt = f"p{n}-{rep}", prompt_of(n, 1000 + rep)
            vx = driver.step([driver.add(rid, prompt, n + 1)], {rid: n})
            driver.finish([rid])
            ids = torch.tensor([prompt])
            eager = _timed(lambda ids=ids: hf_step(hf, ids, DynamicCache(), 0))
            static.reset()  # each prompt on an empty cache (untimed)
            comp = _timed(lambda ids=ids: hf_step(compiled, ids, static, 0))
            if rep:
                times["vx"].append(vx)
                times["eager"].append(eager)
                times["compiled"].append(comp)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mode", default="default",
                    choices=("default", "max-autotune-no-cudagraphs"))  # fmt: skip
    ap.add_argument("--no-freezing", action="store_true", help="inductor's freezing off")
    ap.add_argument("--random", action="store_true", help="random SmolLM2-shaped weights")
    ap.add_argument("--cases", default="1,16,64,p128")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from vx.gpu.worker import _settle_for_steps

    torch._inductor.config.freezing = not args.no_freezing
    torch._dynamo.config.cache_size_limit = 64  # one graph per case, none evicted
    cases = args.cases.split(",")
    batches = [int(c) for c in cases if not c.startswith("p")]
    prefills = [int(c[1:]) for c in cases if c.startswith("p")]

    path, tmp = model_path(args.random)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    compiled = torch.compile(
        hf.forward, fullgraph=True, dynamic=False,
        mode=None if args.mode == "default" else args.mode,
    )  # fmt: skip
    per_req = math.ceil((KV_LEN + args.repeats + 2) / BLOCK_SIZE)
    num_blocks = max([*batches, 1]) * per_req + math.ceil((max([*prefills, 1]) + 1) / BLOCK_SIZE)
    runner = build_runner(path, args.threads, num_blocks + 8)
    _settle_for_steps("cpu")  # as the Worker does before its first step (both sides get it)
    driver = Driver(runner, num_blocks + 8)

    rows = [(f"decode b={b} kv={KV_LEN}", bench_decode(driver, hf, compiled, b, args.repeats))
            for b in batches]  # fmt: skip
    rows += [(f"prefill {n}", bench_prefill(driver, hf, compiled, n, args.repeats))
             for n in prefills]  # fmt: skip
    print(
        f"\nSmolLM2-135M bf16{' (random)' if args.random else ''}, {args.threads} threads, "
        f"torch {torch.__version__}, inductor mode {args.mode}, freezing "
        f"{'off' if args.no_freezing else 'on'}, median of {args.repeats}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'case':<22} {'vx ms':>8} {'eager ms':>9} {'compiled':>9} {'comp/eager':>10} "
          f"{'vx/comp':>8} {'compile s':>9}")  # fmt: skip
    for name, t in rows:
        v, e, c = (statistics.median(t[k]) * 1e3 for k in ("vx", "eager", "compiled"))
        print(f"{name:<22} {v:>8.1f} {e:>9.1f} {c:>9.1f} {c / e:>10.2f} {v / c:>8.2f} "
              f"{t['compile'][0]:>9.1f}")  # fmt: skip
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
