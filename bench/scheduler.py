"""Scheduler micro-benchmark: vx's Scheduler against vLLM's V1 Scheduler, same workloads, same run.

Runs in: a plain process (no EngineCore, no workers). The vx part runs here; the vLLM part runs
this same file in a subprocess under vLLM's interpreter (`--vllm-python`, env VLLM_PYTHON, or
~/.cache/vx-peers/vllmcpu/bin/python; set up with `peers.sh vllm-setup` from the shared peers folder).

Timed per step: `add_request` for that step's arrivals, `schedule()`, `update_from_output()` and
the stats snapshot (`make_stats()` in vx; vLLM builds its stats inside `update_from_output` with
log_stats on, as its server does). Not timed: building the fake `ModelRunnerOutput` (the
worker's job). Every sampled token is a fixed function of (step, row), and every request uses
ignore_eos, so both schedulers see exactly the same work.

Workloads:
- decode-256 / decode-1024: that many requests with distinct 128-token prompts, all decoding;
- mixed: 8 arrivals per step with one of 4 shared 512-token system prompts (prefix hits) plus
  a distinct 64..255-token suffix and 16..79 output tokens, budget 2,048 (chunked prefill),
  up to 256 running.

Usage: flock /tmp/vx-bench.lock .venv/bin/python bench/scheduler.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time
from collections import deque

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = pathlib.Path.home() / ".cache/vx-peers/vllmcpu/bin/python"
BLOCK_SIZE = 16
VOCAB = 30_000


def workloads(steps: int) -> dict[str, dict]:
    """Each workload: limits, and the arrivals (request_id, prompt, max_tokens) of each step."""
    out = {}
    for n in (256, 1024):
        rng = random.Random(n)
        reqs = [
            (f"d{n}-{i}", [rng.randrange(3, VOCAB) for _ in range(128)], 1_000_000)
            for i in range(n)
        ]
        warmup = -(-n * 128 // 8192) + 3  # prefill every prompt, then settle
        out[f"decode-{n}"] = dict(
            max_num_seqs=n,
            max_num_batched_tokens=8192,
            num_blocks=n * (128 + warmup + steps + 64) // BLOCK_SIZE + 64,
            arrivals={0: reqs},
            warmup=warmup,
            steps=steps,
        )
    rng = random.Random(7)
    systems = [[rng.randrange(3, VOCAB) for _ in range(512)] for _ in range(4)]
    arrivals: dict[int, list] = {}
    total_steps = 2 * steps
    for step in range(total_steps):
        arrivals[step] = [
            (
                f"m-{step}-{k}",
                systems[rng.randrange(4)]
                + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(64, 256))],
                rng.randrange(16, 80),
            )
            for k in range(8)
        ]
    out["mixed"] = dict(
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        num_blocks=20_000,
        arrivals=arrivals,
        warmup=steps,
        steps=steps,
    )
    return out


def sampled_token(step: int, row: int) -> int:
    return 3 + (step * 7919 + row * 104_729) % (VOCAB - 3)


def drive(adapter, spec: dict, is_async: bool) -> dict[str, float]:
    """The EngineCore loop with a batch queue of 1 (sync) or 2 (async); returns timings."""
    depth = 2 if is_async else 1
    queue: deque = deque()
    times: list[float] = []
    num_reqs: list[int] = []
    warmup, steps = spec["warmup"], spec["steps"]
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        for request_id, prompt, max_tokens in spec["arrivals"].get(step, ()):
            adapter.add(request_id, prompt, max_tokens)
        t_add = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = adapter.schedule()
        t_sched = time.perf_counter() - t0
        queue.append((out, adapter.fake_result(out, step)))
        t_upd = 0.0
        if len(queue) >= depth:
            out, result = queue.popleft()
            t0 = time.perf_counter()
            adapter.update(out, result)
            t_upd = time.perf_counter() - t0
        if step >= warmup:
            times.append(t_add + t_sched + t_upd)
            num_reqs.append(adapter.num_scheduled(out))
    mean = sum(times) / len(times)
    return {"us_per_step": 1e6 * mean, "reqs_per_step": sum(num_reqs) / len(num_reqs)}


# ── vx ──────────────────────────────────────────────────────────────────────────────────


class VxAdapter:
    def __init__(self, spec: dict, is_async: bool) -> None:
        from vx.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
        from vx.core.scheduler import Scheduler
        from vx.messages import AddRequest, ModelRunnerOutput
        from vx.sampling_params import SamplingParams

        config = EngineConfig(
            model=ModelConfig(max_model_len=spec["num_blocks"] * BLOCK_SIZE),
            cache=CacheConfig(enable_prefix_caching=True),
            scheduler=SchedulerConfig(
                max_num_seqs=spec["max_num_seqs"],
                max_num_batched_tokens=spec["max_num_batched_tokens"],
                async_scheduling=is_async,
            ),
        )
        self.scheduler = Scheduler(config, spec["num_blocks"])
        self.is_async = is_async
        self._add, self._mro, self._sp = AddRequest, ModelRunnerOutput, SamplingParams

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = self._sp.create(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.scheduler.add_request(
            self._add(request_id=request_id, prompt_token_ids=prompt, sampling_params=params)
        )

    def schedule(self):
        return self.scheduler.schedule()

    def update(self, out, result) -> None:
        self.scheduler.update_from_output(out, result)
        self.scheduler.make_stats()

    def fake_result(self, out, step: int):
        requests = self.scheduler.requests
        lag = 1 if self.is_async else 0
        req_ids, sampled = [], []
        for row, request_id in enumerate(out.num_scheduled_tokens):
            r = requests[request_id]
            req_ids.append(request_id)
            done = r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders - lag
            sampled.append([sampled_token(step, row)] if done else [])
        return self._mro(step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled)

    @staticmethod
    def num_scheduled(out) -> int:
        return len(out.num_scheduled_tokens)


# ── vLLM (runs under vLLM's interpreter) ────────────────────────────────────────────────


class VllmAdapter:
    def __init__(self, spec: dict, is_async: bool) -> None:
        import tempfile

        import torch
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        # A config-only model directory: the scheduler never loads weights or a tokenizer.
        model_dir = tempfile.mkdtemp(prefix="vx-bench-model-")
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 4,
                    "num_hidden_layers": 2,
                    "vocab_size": VOCAB,
                    "max_position_embeddings": 1 << 20,
                    "torch_dtype": "float32",
                },
                f,
            )
        max_model_len = 1 << 20
        model_config = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="float32"
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=spec["max_num_seqs"],
            max_num_batched_tokens=spec["max_num_batched_tokens"],
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
        cache_config.num_gpu_blocks = spec["num_blocks"]
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            device_config=DeviceConfig("cpu"),
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=spec["num_blocks"],
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                    ),
                )
            ],
        )
        cls = AsyncScheduler if is_async else Scheduler
        self.scheduler = cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self._req, self._sp, self._mro = Request, SamplingParams, ModelRunnerOutput

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = self._sp(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.scheduler.add_request(
            self._req(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                arrival_time=time.time(),
                block_hasher=self._hasher,
            )
        )

    def schedule(self):
        return self.scheduler.schedule()

    def update(self, out, result) -> None:
        self.scheduler.update_from_output(out, result)

    def fake_result(self, out, step: int):
        requests = self.scheduler.requests
        req_ids, sampled = [], []
        for row, request_id in enumerate(out.num_scheduled_tokens):
            req_ids.append(request_id)
            prefill_chunk = requests[request_id].is_prefill_chunk
            sampled.append([] if prefill_chunk else [sampled_token(step, row)])
        return self._mro(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    @staticmethod
    def num_scheduled(out) -> int:
        return len(out.num_scheduled_tokens)


# ── the two sides and the table ─────────────────────────────────────────────────────────


def run_side(side: str, steps: int, repeats: int) -> dict[str, list[dict]]:
    adapter_cls = VxAdapter if side == "vx" else VllmAdapter
    results: dict[str, list[dict]] = {}
    for name, spec in workloads(steps).items():
        for is_async in (False, True):
            key = f"{name} {'async' if is_async else 'sync'}"
            for _ in range(repeats):
                results.setdefault(key, []).append(
                    drive(adapter_cls(spec, is_async), spec, is_async)
                )
    return results


def run_vllm(python: str, steps: int) -> dict[str, list[dict]] | None:
    """One repeat of every workload under vLLM's interpreter (a fresh process each time)."""
    if not os.path.exists(python):
        print(f"[vLLM skipped: no interpreter at {python}; run peers.sh vllm-setup]")
        return None
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run(
        [python, __file__, "--side", "vllm", "--steps", str(steps), "--repeats", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if proc.returncode != 0:
        print(f"[vLLM side failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}]")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="timed steps per workload")
    ap.add_argument("--repeats", type=int, default=3, help="runs per workload; medians reported")
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON", str(DEFAULT_VLLM_PYTHON)),
        help="vLLM's interpreter ('' to skip vLLM)",
    )
    ap.add_argument(
        "--side", choices=("both", "vx", "vllm"), default="both", help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.side == "vllm":
        print(json.dumps(run_side("vllm", args.steps, args.repeats)))
        return
    sys.path.insert(0, str(ROOT))
    # Interleave the two sides repeat by repeat: this machine drifts between a fast and a slow
    # state, and interleaving spreads the drift over both.
    vx: dict[str, list[dict]] = {}
    vl: dict[str, list[dict]] | None = {} if args.vllm_python else None
    for _ in range(args.repeats):
        for key, runs in run_side("vx", args.steps, 1).items():
            vx.setdefault(key, []).extend(runs)
        if vl is not None:
            got = run_vllm(args.vllm_python, args.steps)
            if got is None:
                vl = None
                continue
            for key, runs in got.items():
                vl.setdefault(key, []).extend(runs)

    def med(runs: list[dict], field: str) -> float:
        return statistics.median(r[field] for r in runs)

    print(
        f"median of {args.repeats} runs, {args.steps} timed steps each; "
        "us = schedule + update (+ adds, + stats) per step"
    )
    header = f"{'workload':<18}{'reqs/step':>10}{'vx us/step':>12}{'vx us/req':>11}"
    header += f"{'vLLM reqs':>11}{'vLLM us/step':>14}{'vLLM us/req':>13}{'vx/vLLM':>9}"
    print(header)
    for key, runs in vx.items():
        reqs = med(runs, "reqs_per_step")
        us = med(runs, "us_per_step")
        line = f"{key:<18}{reqs:>10.0f}{us:>12.0f}{us / reqs:>11.2f}"
        if vl and key in vl:
            vreqs, vus = med(vl[key], "reqs_per_step"), med(vl[key], "us_per_step")
            line += f"{vreqs:>11.0f}{vus:>14.0f}{vus / vreqs:>13.2f}{us / vus:>9.2f}"
        print(line)


if __name__ == "__main__":
    main()
