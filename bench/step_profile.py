"""Where a model step's time goes: the step as served, and the same step op by op.

Usage (always under the shared benchmark lock):

    flock /tmp/vx-bench.lock .venv/bin/python bench/step_profile.py [--threads 2]
        [--repeats 10] [--decodes 64] [--kv 192] [--prompts 4] [--prompt-len 128] [--random]

Model: SmolLM2-135M in bf16 (`--random`: random weights of its shapes; timings do not depend on
the weights), driven by `bench/forward.py`'s `Driver` (hand-made SchedulerOutputs, greedy).
Cases: a decode step (`--decodes` rows, each with ~`--kv` keys), a prefill step (`--prompts`
prompts of `--prompt-len` tokens) and the two mixed in one step. Each case alternates, step by
step, the ModelRunner as served (whatever it takes: the fused C step, the split decode step,
the one-call greedy step) with the module path (the runner's `fused_step` set aside for that
step: every layer's ops from Python, each one timed).

The module path calls the same kernels as the fused step with the same rows (that is what
makes their tokens the same), so its per-op times say what each op costs; the fused step's
total against theirs says what the step as served gains or loses around them (Python
dispatch, parallel regions, threads waiting on each other). Printed per case, as medians over
the repeats: the step as served, the module path's step, and the module path's ops:
  - qkv, o, gate_up, down: the linears (every layer's);
  - attention: the paged attention call (decode and prefill rows);
  - norms, rotary, silu_mul, embedding: the rest of the layers' ops;
  - python: the model's forward less the ops above (Python, views, the residual glue);
  - head+sampler: `ModelRunner.execute` less the model's forward (inputs, the LM head or its
    argmax, the sampler, the batch's bookkeeping).
The timers cost ~1-2 us an op (~300 ops a step); the module path's step includes them.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.forward import Driver, model_path, prompt_of
from vx.config import BLOCK_SIZE, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vx.gpu.model_runner import ModelRunner

#: The module path's op categories, in the order printed.
OPS = (
    "qkv", "o", "gate_up", "down", "attention", "norms", "rotary", "silu_mul", "embedding",
    "python", "head+sampler",
)  # fmt: skip


class OpTimer:
    """Times the module path's ops by category while `active` (hooks and wrappers stay
    installed until `close`; inactive, each costs one attribute check). `times[op]` sums the
    seconds of the current `module_path` step."""

    def __init__(self, runner: ModelRunner) -> None:
        import vx.gpu.layers.linear as layers_mod
        import vx.gpu.models.llama as llama_mod

        self.active = False
        self.times: dict[str, float] = defaultdict(float)
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str, Any]] = []
        inner = runner.model.model
        self.runner = runner
        for layer in inner.layers:
            attn = layer.self_attn
            self._time_module(attn.qkv_proj, "qkv")
            self._time_module(attn.o_proj, "o")
            self._time_module(layer.mlp.gate_up_proj, "gate_up")
            vnni = layer.mlp.gate_up_proj.vnni
            if vnni is not None and vnni.silu:  # the GEMM with the SiLU-mul in its epilogue
                self._patch(vnni, "apply_silu", "gate_up")
            vnni = attn.qkv_proj.vnni
            if vnni is not None and vnni.amx:  # the GEMM with the rotary in its epilogue
                self._patch(vnni, "apply_rope", "qkv")
            self._time_module(layer.mlp.down_proj, "down")
            self._time_module(layer.input_layernorm, "norms")
            self._time_module(layer.post_attention_layernorm, "norms")
            self._patch(attn, "attn_fn", "attention")
        self._time_module(inner.norm, "norms")
        self._time_module(inner.embed_tokens, "embedding")
        self._time_module(inner, "model")
        self._patch(llama_mod, "apply_rotary", "rotary")
        self._patch(layers_mod, "silu_and_mul", "silu_mul")  # the gate-up's SiLU pass

    def _time_module(self, module: torch.nn.Module, op: str) -> None:
        starts: list[float] = []

        def pre(_m: Any, _a: Any) -> None:
            if self.active:
                starts.append(time.perf_counter())

        def post(_m: Any, _a: Any, _o: Any) -> None:
            if self.active and starts:
                self.times[op] += time.perf_counter() - starts.pop()

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def _patch(self, owner: Any, name: str, op: str) -> None:
        fn: Callable = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[op] += time.perf_counter() - t0

        own = name in getattr(owner, "__dict__", {})  # else a method: the instance's goes
        setattr(owner, name, timed)
        self._patched.append((owner, name, fn if own else None))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        for owner, name, fn in self._patched:
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)

    @contextlib.contextmanager
    def module_path(self) -> Iterator[dict[str, float]]:
        """One step on the module path, timed: yields the dict the step's op times land in
        (complete once the block ends)."""
        saved = self.runner.fused_step
        self.runner.fused_step = None
        self.times = defaultdict(float)
        self.active = True
        try:
            yield self.times
        finally:
            self.active = False
            self.runner.fused_step = saved


def breakdown(times: dict[str, float], step: float) -> dict[str, float]:
    """The module path's op times for one step of `step` seconds, by `OPS` category: python is
    the model's forward less its timed ops, head+sampler the step less the model's forward."""
    model = times.get("model", 0.0)
    out = {op: times.get(op, 0.0) for op in OPS if op not in ("python", "head+sampler")}
    out["python"] = max(0.0, model - sum(out.values()))
    out["head+sampler"] = max(0.0, step - model)
    return out


def _vocab(runner: ModelRunner) -> int:
    return int(runner.model.model.embed_tokens.weight.shape[0])


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    """`bench/forward.py`'s random prompt, folded into the model's vocabulary."""
    return [t % vocab for t in prompt_of(n, seed)]


class Case:
    """A step shape: `decodes` rows that stay (one token each a step) and `prompts` new
    prompts of `prompt_len` tokens a step (each finished right after its prefill)."""

    def __init__(self, name: str, driver: Driver, decodes: list[str], prompts: int,
                 prompt_len: int) -> None:  # fmt: skip
        self.name, self.driver, self.decodes = name, driver, decodes
        self.prompts, self.prompt_len = prompts, prompt_len
        self.k = 0
        self.vocab = _vocab(driver.runner)

    def step(self) -> float:
        d = self.driver
        ids = [f"{self.name}-{self.k}-{j}" for j in range(self.prompts)]
        self.k += 1
        new = [
            d.add(r, _prompt(self.prompt_len, 10_000 + self.k * 64 + j, self.vocab), self.prompt_len + 1)
            for j, r in enumerate(ids)
        ]  # fmt: skip
        sched = dict.fromkeys(self.decodes, 1)
        sched.update(dict.fromkeys(ids, self.prompt_len))
        dt = d.step(new, sched)
        d.finish(ids)
        return dt


def run_case(case: Case, timer: OpTimer, repeats: int) -> tuple[list[float], list[float], dict]:
    """Alternates served and module-path steps (one warm-up each); returns both step times
    and the module path's per-op medians."""
    served, module, ops = [], [], defaultdict(list)
    for i in range(repeats + 1):
        t = case.step()
        with timer.module_path() as times:
            m = case.step()
        if i == 0:
            continue
        served.append(t)
        module.append(m)
        for op, v in breakdown(times, m).items():
            ops[op].append(v)
    return served, module, {op: statistics.median(v) for op, v in ops.items()}


def build_runner(path: str, threads: int, num_blocks: int) -> ModelRunner:
    config = EngineConfig(
        model=ModelConfig(path=path, dtype="bfloat16", max_model_len=4096),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
        cache=CacheConfig(num_blocks_override=num_blocks),
        num_threads=threads,
    )
    config.validate()
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks()[0])
    return runner


def profile(runner: ModelRunner, num_blocks: int, *, decodes: int, kv: int, prompts: int,
            prompt_len: int, repeats: int, settle: bool = True) -> list[tuple]:  # fmt: skip
    """[(case name, served step times, module step times, per-op medians)] for the decode,
    prefill and mixed cases (a case with no rows is left out)."""
    if settle:
        from vx.gpu.worker import _settle_for_steps

        _settle_for_steps("cpu")
    driver = Driver(runner, num_blocks)
    dec = [f"d{i}" for i in range(decodes)]
    cap = kv + 4 * (repeats + 1) + 2
    new = [driver.add(r, _prompt(kv, i, _vocab(runner)), cap) for i, r in enumerate(dec)]
    per = max(1, 1024 // max(kv, 1))
    for i in range(0, decodes, per):  # their prompts: untimed
        driver.step(new[i : i + per], {r: kv for r in dec[i : i + per]})
    timer = OpTimer(runner)
    out = []
    try:
        cases = [("decode", dec, 0), ("prefill", [], prompts), ("mixed", dec, prompts)]
        for name, rows, n in cases:
            if not rows and not n:
                continue
            case = Case(name, driver, rows, n, prompt_len)
            out.append((name, *run_case(case, timer, repeats)))
    finally:
        timer.close()
    return out


def report(results: list[tuple], header: str) -> str:
    lines = [header, f"{'case':<9} {'served':>9} {'module':>9}  " + " ".join(f"{o:>9}" for o in OPS)]
    for name, served, module, ops in results:
        s, m = statistics.median(served) * 1e3, statistics.median(module) * 1e3
        cells = " ".join(f"{ops[o] * 1e3:>9.2f}" for o in OPS)
        lines.append(f"{name:<9} {s:>9.2f} {m:>9.2f}  {cells}")
    lines.append("(ms, medians; served: the step as the Worker runs it; module: the module path, "
                 "whose ops follow)")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--kv", type=int, default=192, help="keys each decode row starts with")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--random", action="store_true", help="random SmolLM2-shaped weights")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path, tmp = model_path(args.random)
    per_req = math.ceil((args.kv + 4 * (args.repeats + 1) + 2) / BLOCK_SIZE)
    num_blocks = args.decodes * per_req + args.prompts * 2 * math.ceil(
        (args.prompt_len + 1) / BLOCK_SIZE
    ) + 8
    runner = build_runner(path, args.threads, num_blocks)
    results = profile(
        runner, num_blocks, decodes=args.decodes, kv=args.kv, prompts=args.prompts,
        prompt_len=args.prompt_len, repeats=args.repeats,
    )  # fmt: skip
    print(report(results, (
        f"SmolLM2-135M bf16{' (random)' if args.random else ''}, {args.threads} threads, "
        f"{args.decodes} decodes x ~{args.kv} keys, {args.prompts} x {args.prompt_len} prompt "
        f"tokens, {args.repeats} repeats, load {os.getloadavg()[0]:.1f}"
    )))  # fmt: skip
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
