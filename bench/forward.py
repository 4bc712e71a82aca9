"""Time one ModelRunner step against HF transformers' forward, in the same run.

Usage (always under the shared benchmark lock):

    flock /tmp/vx-bench.lock .venv/bin/python bench/forward.py [--threads 2] [--repeats 3]
        [--quantization int8|int4] [--no-settle] [--random] [--json FILE]

Model: SmolLM2-135M (`vx.models_hub.resolve.resolve_model("smollm2-135m")`) in bf16, or with
`--random` a random model of the same shapes (timings do not depend on the weights), or with
`--family F` a random bf16 model of that family (tests.models' configs, at `FAMILY_SHAPES`:
SmolLM2's widths, 8 layers; the MoE families 8 experts, top-2, each expert half the dense MLP,
so a token's active MLP is the dense one's; Gemma's windows of 128 keys, so decode cuts them).
Cases: decode steps at batch 1, 16 and 64 with 256 tokens of KV per request, and prefill of
128 and 2,048 tokens (one request). HF runs with its own DynamicCache and SDPA attention; its
prefill asks for the last position's logits only (`logits_to_keep=1`, as `generate` does), so
both sides skip the LM head over the prompt. Each case: one warm-up, then `--repeats` timed
steps per side, interleaved; the table shows medians and vx / HF. `--quantization` runs vx
with weight-only int8/int4 linears (vx.gpu.layers.quantization) against HF in bf16. Before timing,
the process settles as the Worker does before its first step (glibc malloc keeps freed memory,
so activations are not fresh zeroed pages every step; `gc.freeze`); HF's forward, in the same
process, gets the same. `--no-settle` leaves malloc alone, as before 2026-11-30 evening.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

# The OpenMP wait policy is read when torch loads libgomp, so this flag is looked at first.
if "--omp-passive" in sys.argv:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vx.config import BLOCK_SIZE, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vx.gpu.model_runner import ModelRunner
from vx.messages import CachedRequestData, NewRequestData, SchedulerOutput
from vx.sampling_params import SamplingParams

GREEDY = SamplingParams.create(temperature=0.0, max_tokens=4096)
KV_LEN = 256
DECODE_BATCHES = (1, 16, 64)
PREFILLS = (128, 2048)
#: `--family`: the families vx serves, and the shapes their random models get
FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3")
FAMILY_SHAPES = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=4096,
    initializer_range=0.02, dtype="bfloat16",
)  # fmt: skip
FAMILY_EXTRA: dict[str, dict] = {
    "qwen3_moe": {"moe_intermediate_size": 768},
    "mixtral": {"intermediate_size": 768},
    "gemma2": {
        "query_pre_attn_scalar": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 4,
    },
    "gemma3": {  # Gemma 3's five windowed layers to one global (8 layers)
        "query_pre_attn_scalar": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
    },
}


def random_smollm2(path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"], dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def model_path(
    random: bool, family: str | None = None
) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """SmolLM2-135M's directory, or (`random`) a random model of its shapes, or a random model
    of `family`, in a temporary directory that the caller cleans up (the second item; None for
    the real model)."""
    if family is not None:
        from tests.models import make_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="vx-bench-")
        shapes = {**FAMILY_SHAPES, **FAMILY_EXTRA.get(family, {})}
        return make_tiny_model(tmp.name, family, **shapes), tmp
    if random:
        tmp = tempfile.TemporaryDirectory(prefix="vx-bench-")
        return random_smollm2(tmp.name), tmp
    from vx.models_hub.resolve import resolve_model

    return resolve_model("smollm2-135m"), None


class Driver:
    """Feeds the runner hand-made SchedulerOutputs; blocks come from a simple free list.

    With several KV-cache groups (windowed and global layers) a request holds as many blocks in
    each group, none freed out of a window, so the pool needs `num_blocks` per group."""

    def __init__(self, runner: ModelRunner, num_blocks: int) -> None:
        self.runner = runner
        self.groups = runner.kv_groups.num_groups if runner.kv_groups is not None else 1
        self.free = list(range(num_blocks * self.groups))
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.finished: list[str] = []
        self.step_id = 0

    def _so(self, new, cached, sched) -> SchedulerOutput:
        so = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[c for c in cached],
                new_block_ids=[[] for _ in cached],
                num_computed_tokens=[self.computed[c] for c in cached],
            ),  # fmt: skip
            num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()),
            finished_req_ids=self.finished,
        )
        self.finished = []
        self.step_id += 1
        return so

    def add(self, req_id: str, prompt: list[int], capacity: int) -> NewRequestData:
        n = math.ceil(capacity / BLOCK_SIZE)
        self.blocks[req_id] = [self.free.pop() for _ in range(n * self.groups)]
        self.computed[req_id] = 0
        return NewRequestData(
            req_id=req_id, prompt_token_ids=prompt, sampling_params=GREEDY,
            block_ids=self.blocks[req_id], num_computed_tokens=0,
        )  # fmt: skip

    def step(self, new: list[NewRequestData], sched: dict[str, int]) -> float:
        cached = [r for r in sched if r not in {n.req_id for n in new}]
        so = self._so(new, cached, sched)
        t0 = time.perf_counter()
        self.runner.execute(so)
        dt = time.perf_counter() - t0
        for r, n in sched.items():
            self.computed[r] += n
        return dt

    def finish(self, req_ids) -> None:
        for r in req_ids:
            self.free += self.blocks.pop(r)
            self.computed.pop(r)
            self.finished.append(r)


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def bench_decode(driver: Driver, hf, batch: int, repeats: int) -> tuple[list[float], list[float]]:
    from transformers import DynamicCache

    ids = [f"d{batch}-{i}" for i in range(batch)]
    prompts = [prompt_of(KV_LEN, i) for i in range(batch)]
    cap = KV_LEN + repeats + 2
    new = [driver.add(r, p, cap) for r, p in zip(ids, prompts, strict=True)]
    per_step = max(1, 2048 // KV_LEN)
    for i in range(0, batch, per_step):  # prefill, untimed
        driver.step(new[i : i + per_step], {r: KV_LEN for r in ids[i : i + per_step]})
    vx_times = [driver.step([], dict.fromkeys(ids, 1)) for _ in range(repeats + 1)][1:]
    driver.finish(ids)

    with torch.inference_mode():
        cache = DynamicCache()
        hf(torch.tensor(prompts), past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = torch.randint(100, 40000, (batch, 1))
        hf_times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            hf(tok, past_key_values=cache, use_cache=True)
            hf_times.append(time.perf_counter() - t0)
    return vx_times, hf_times[1:]


def bench_prefill(driver: Driver, hf, n: int, repeats: int) -> tuple[list[float], list[float]]:
    from transformers import DynamicCache

    vx_times, hf_times = [], []
    for rep in range(repeats + 1):
        rid = f"p{n}-{rep}"
        prompt = prompt_of(n, 1000 + rep)
        new = driver.add(rid, prompt, n + 1)
        vx_times.append(driver.step([new], {rid: n}))
        driver.finish([rid])
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf(
                torch.tensor([prompt]),
                past_key_values=DynamicCache(),
                use_cache=True,
                logits_to_keep=1,
            )
            hf_times.append(time.perf_counter() - t0)
    return vx_times[1:], hf_times[1:]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--random", action="store_true", help="random SmolLM2-shaped weights")
    ap.add_argument("--family", choices=FAMILIES, default=None, help="a random model of it")
    ap.add_argument("--only", choices=("decode", "prefill"), default=None)
    ap.add_argument("--quantization", choices=("int8", "int4"), default=None, help="vx side only")
    ap.add_argument(
        "--omp-passive",
        action="store_true",
        help="OMP_WAIT_POLICY=PASSIVE (both sides): on a machine whose cores are shared, "
        "spinning OpenMP threads slow 2-thread steps down by up to 10x",
    )
    ap.add_argument(
        "--no-settle", action="store_true", help="skip the Worker's settling (malloc tuning)"
    )
    ap.add_argument("--json", default=None, help="also write the table's rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path, tmp = model_path(args.random, args.family)
    prefills = PREFILLS[:1] if args.family else PREFILLS  # the 128-token prefill
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    num_blocks = max(DECODE_BATCHES) * math.ceil((KV_LEN + args.repeats + 2) / BLOCK_SIZE) + 8
    num_blocks = max(num_blocks, math.ceil((max(prefills) + 1) / BLOCK_SIZE) + 8)
    config = EngineConfig(
        model=ModelConfig(
            path=path, dtype="bfloat16", max_model_len=4096, quantization=args.quantization
        ),
        scheduler=SchedulerConfig(max_num_seqs=max(DECODE_BATCHES), max_num_batched_tokens=2048),
        cache=CacheConfig(num_blocks_override=num_blocks),
        num_threads=args.threads,
    )
    config.validate()
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks()[0] * runner.kv_groups.num_groups)
    if not args.no_settle:
        # As the Worker does before its first step (malloc keeps freed memory, gc.freeze); it is
        # process-wide, so HF's forward in this process gets it too.
        from vx.gpu.worker import _settle_for_steps

        _settle_for_steps("cpu")
    driver = Driver(runner, num_blocks)

    rows = []
    if args.only in (None, "decode"):
        for b in DECODE_BATCHES:
            rows.append((f"decode b={b} kv={KV_LEN}", *bench_decode(driver, hf, b, args.repeats)))
    if args.only in (None, "prefill"):
        for n in prefills:
            rows.append((f"prefill {n}", *bench_prefill(driver, hf, n, args.repeats)))

    name = f"random {args.family} (8 layers)" if args.family else "SmolLM2-135M"
    print(
        f"\n{name} bf16{' (vx: ' + args.quantization + ')' if args.quantization else ''}, "
        f"{args.threads} threads"
        f"{', passive OpenMP' if args.omp_passive else ''}, median of {args.repeats}, "
        f"load {os.getloadavg()[0]:.1f} ({'random' if args.random or args.family else path})"
    )
    print(f"{'case':<22} {'HF ms':>9} {'vx ms':>9} {'vx/HF':>7}  goal <= 0.50")
    table = []
    for name, vx_t, hf_t in rows:
        v, h = statistics.median(vx_t) * 1e3, statistics.median(hf_t) * 1e3
        print(f"{name:<22} {h:>9.1f} {v:>9.1f} {v / h:>7.2f}  {'ok' if v / h <= 0.5 else 'MISS'}")
        table.append(dict(case=name, hf_ms=round(h, 2), vx_ms=round(v, 2), ratio=round(v / h, 3)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    threads=args.threads,
                    repeats=args.repeats,
                    random=args.random,
                    family=args.family,
                    quantization=args.quantization,
                    rows=table,
                ),
                f,
                indent=1,
            )
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
