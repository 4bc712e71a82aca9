"""Where a mixture-of-experts model's step goes: its layers' parts timed one by one.

Usage (always under the exclusive benchmark lock):

    python bench/moe_profile.py DIR [--decodes 1,32] [--prefills 8] [--repeats 6] [--threads 2]

DIR: a Qwen3-MoE or Mixtral directory (`bench/random_moe.py` writes a 1 B one). The ModelRunner
as served, fed by `bench/forward.py`'s `Driver`: decode steps of each `--decodes` batch (rows at ~160 keys) and
prefill steps of `--prefills` prompts of 128 tokens. Printed per case, medians over the repeats
(ms): the step, the model's forward, and each layer part summed over the layers: norms,
attention (`attn`: `project` = qkv GEMM + q/k norms + rotary, `qkv` alone, the paged
`attn_kernel`, `o_proj`), the MoE block (`moe`: `router` GEMM, `experts` = the experts' call,
their GEMMs `e_gemms` (on AMX one C call a layer); the rest of `experts` is the grouping and
weighted sum, the rest of `moe` the top-k). The timers cost ~1 us a part. NOTE: on AMX the
fused C step takes a MoE model's steps of up to 192 rows (`vx.gpu.cpu.fused_step`), where no
part is timed (only `step`): `VX_CPU_DECODE_STEP=0` times the module path's parts.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.forward import Driver, prompt_of
from vx.config import BLOCK_SIZE, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vx.gpu.model_runner import ModelRunner

KV = 160


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("dir")
    ap.add_argument("--decodes", default="1,32")
    ap.add_argument("--prefills", default="8")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    batches = [int(b) for b in args.decodes.split(",") if b]
    prefills = [int(n) for n in args.prefills.split(",") if n]
    reps = args.repeats
    nb = max(batches + prefills) * math.ceil((KV + reps + 4) / BLOCK_SIZE) + 8
    config = EngineConfig(
        model=ModelConfig(path=args.dir, dtype="bfloat16", max_model_len=4096),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192),
        cache=CacheConfig(num_blocks_override=nb),
        num_threads=args.threads,
    )
    config.validate()
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks()[0])
    from vx.gpu.layers import cpu_experts
    from vx.gpu.worker import _settle_for_steps

    _settle_for_steps("cpu")
    times: dict[str, float] = defaultdict(float)
    active = [False]

    def timed(f, part: str):
        def run(*a, **kw):
            if not active[0]:
                return f(*a, **kw)
            t0 = time.perf_counter()
            out = f(*a, **kw)
            times[part] += time.perf_counter() - t0
            return out

        return run

    def wrap(obj, name: str, part: str) -> None:
        setattr(obj, name, timed(getattr(obj, name), part))

    for layer in runner.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        wrap(layer.input_layernorm, "forward", "norms")
        wrap(layer.post_attention_layernorm, "forward", "norms")
        wrap(attn, "forward", "attn")
        wrap(attn, "project", "project")
        wrap(attn.qkv_proj, "forward", "qkv")
        wrap(attn, "attn_fn", "attn_kernel")
        wrap(attn.o_proj, "forward", "o_proj")
        wrap(mlp, "forward", "moe")
        wrap(mlp.gate, "forward", "router")
        experts = mlp.experts.experts_fn
        wrap(mlp.experts, "experts_fn", "experts")
        if isinstance(experts, cpu_experts.CpuExperts):
            wrap(experts, "_run_experts", "e_gemms")
    wrap(runner.model, "forward", "model")
    driver = Driver(runner, nb)

    def report(name: str, steps: list[float], acc: dict[str, list[float]]) -> None:
        parts = ", ".join(f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in acc.items())
        print(f"{name}: step {statistics.median(steps) * 1e3:.1f} ms; {parts}")

    def timed_step(new, sched, acc) -> float:
        times.clear()
        active[0] = True
        dt = driver.step(new, sched)
        active[0] = False
        for k, v in times.items():
            acc[k].append(v)
        return dt

    for n in prefills:
        steps: list[float] = []
        acc: dict[str, list[float]] = defaultdict(list)
        for rep in range(reps // 2 + 1):
            ids = [f"p{n}-{rep}-{i}" for i in range(n)]
            new = [driver.add(r, prompt_of(128, 50 + i), 130) for i, r in enumerate(ids)]
            steps.append(timed_step(new, dict.fromkeys(ids, 128), acc))
            driver.finish(ids)
        report(f"prefill {n} x 128", steps[1:], {k: v[1:] for k, v in acc.items()})
    for b in batches:
        ids = [f"d{b}-{i}" for i in range(b)]
        new = [driver.add(r, prompt_of(KV, i), KV + reps + 4) for i, r in enumerate(ids)]
        for i in range(0, b, 8):
            driver.step(new[i : i + 8], {r: KV for r in ids[i : i + 8]})
        driver.step([], dict.fromkeys(ids, 1))
        acc = defaultdict(list)
        steps = [timed_step([], dict.fromkeys(ids, 1), acc) for _ in range(reps)]
        driver.finish(ids)
        report(f"decode b={b}", steps, acc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
