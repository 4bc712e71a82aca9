"""The GPU device check's Python half: each subcommand adds rows to a JSON-lines results file,
and `table` prints them as one table. bench/gpu_check.sh runs the sections in order.

    python bench/gpu_check.py env      --results R.jsonl
    python bench/gpu_check.py triton   --results R.jsonl
    python bench/gpu_check.py parity   --results R.jsonl [--model DIR]
    python bench/gpu_check.py decode   --results R.jsonl [--steps 20]
    python bench/gpu_check.py make-model DIR        (random SmolLM2-shaped model + tokenizer)
    python bench/gpu_check.py serve-row --results R.jsonl --json SERVE.json [--label TEXT]
    python bench/gpu_check.py table    --results R.jsonl

Sections:
- env: device, memory, torch/triton versions, the per-hardware defaults vx picks here;
- triton: the Triton kernels against their torch references at Llama-8B head sizes
  (32 q heads, 8 kv heads, dim 128), bf16 and fp16, with kernel times;
- parity: greedy tokens of the vx ModelRunner on the GPU (fp32, CUDA graphs on) against HF
  transformers on the GPU, for SmolLM2-135M when its converted weights are in the vx cache
  (or --model), else for a random SmolLM2-shaped model (the row says which);
- decode: one decode step (ModelRunner.execute: input prep, forward, sampling) of a
  Llama-3.1-8B-shaped model with random bf16 weights at batch 1, 8, 64 and 256, eager and
  with CUDA graphs, against the weight-streaming floor: the weights' bytes over the
  device-to-device copy bandwidth measured here (bytes read + written per second).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vx.config import BLOCK_SIZE, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vx.messages import CachedRequestData, NewRequestData, SchedulerOutput
from vx.sampling_params import SamplingParams

GREEDY = SamplingParams.create(temperature=0.0, max_tokens=100_000, ignore_eos=True)


def record(path: str, section: str, check: str, result: str, status: str = "ok") -> None:
    print(f"[{section}] {check}: {result} ({status})", flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(dict(section=section, check=check, result=result, status=status)))
        f.write("\n")


# ───────────────────────────── a hand driver for ModelRunner ─────────────────────────────


class Driver:
    """SchedulerOutputs by hand: each request gets its blocks for `capacity` tokens up front."""

    def __init__(self, runner, num_blocks: int) -> None:
        self.runner = runner
        self.free = list(range(num_blocks))[::-1]
        self.computed: dict[str, int] = {}
        self.step_id = 0

    def add(self, req_id: str, prompt: list[int], capacity: int) -> NewRequestData:
        blocks = [self.free.pop() for _ in range(math.ceil(capacity / BLOCK_SIZE))]
        self.computed[req_id] = 0
        return NewRequestData(
            req_id=req_id, prompt_token_ids=list(prompt), sampling_params=GREEDY,
            block_ids=blocks, num_computed_tokens=0,
        )  # fmt: skip

    def step(self, new: list[NewRequestData], sched: dict[str, int]):
        fresh = {n.req_id for n in new}
        cached = [r for r in sched if r not in fresh]
        so = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=cached,
                new_block_ids=[[] for _ in cached],
                num_computed_tokens=[self.computed[r] for r in cached],
            ),
            num_scheduled_tokens=dict(sched),
            total_num_scheduled_tokens=sum(sched.values()),
            finished_req_ids=[],
        )
        self.step_id += 1
        out = self.runner.execute(so)
        for r, n in sched.items():
            self.computed[r] += n
        return out


def _runner_config(
    path: str, dtype: str, max_model_len: int, max_num_seqs: int, blocks: int, eager: bool = False
) -> EngineConfig:
    config = EngineConfig(
        model=ModelConfig(path=path, dtype=dtype, max_model_len=max_model_len),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
        cache=CacheConfig(num_blocks_override=blocks),
        device="cuda",
        enforce_eager=eager,
    )
    config.validate()
    return config


# ───────────────────────────── sections ─────────────────────────────


def cmd_env(args) -> None:
    from vx.config import default_max_num_batched_tokens
    from vx.gpu.cuda_graphs import cudagraph_capture_sizes
    from vx.models_hub.device import device_total_memory

    props = torch.cuda.get_device_properties(0)
    import triton

    record(args.results, "env", "device", f"{props.name}, {props.total_memory / 2**30:.1f} GiB")
    record(
        args.results, "env", "versions", f"torch {torch.__version__}, triton {triton.__version__}"
    )
    mem = device_total_memory("cuda")
    server = default_max_num_batched_tokens(mem, offline=False)
    offline = default_max_num_batched_tokens(mem, offline=True)
    ok = "ok" if mem is not None and (server == 8192) == (mem < 160 * 2**30) else "FAIL"
    gib = "?" if mem is None else f"{mem / 2**30:.1f}"
    record(
        args.results, "env", "defaults", f"NVML/torch {gib} GiB -> server {server}, "
        f"offline {offline}; {len(cudagraph_capture_sizes(1024))} capture sizes", ok,
    )  # fmt: skip


def _time_cuda(fn, reps: int = 20) -> float:
    """Median milliseconds of fn() on the GPU (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cmd_triton(args) -> None:
    import numpy as np

    from vx.gpu.attention import triton as ta
    from vx.gpu.attention.paged import build_attention_metadata

    dev = "cuda"
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).replace("torch.", "")
        for label, reqs in (
            ("decode b=64 ctx=4096", [(4095, 1)] * 64),
            ("prefill 2048 after 2048 cached", [(2048, 2048)]),
            (
                "mixed 32 decodes + 512 prefill",
                [(1000 + 37 * i, 1) for i in range(32)] + [(0, 512)],
            ),
        ):
            rng = np.random.default_rng(0)
            nblk = [-(-(nc + n) // BLOCK_SIZE) for nc, n in reqs]
            total = sum(nblk) + 4
            perm = rng.permutation(total)
            bt = np.zeros((len(reqs), max(nblk)), np.int32)
            off = 0
            for i, nb in enumerate(nblk):
                bt[i, :nb] = perm[off : off + nb]
                off += nb
            slots = np.concatenate([
                bt[i, np.arange(nc, nc + n) // BLOCK_SIZE] * BLOCK_SIZE
                + np.arange(nc, nc + n) % BLOCK_SIZE
                for i, (nc, n) in enumerate(reqs)
            ])  # fmt: skip
            nd = sum(1 for _, n in reqs if n == 1)
            md = build_attention_metadata(
                query_lens=np.array([n for _, n in reqs]),
                num_computed=np.array([nc for nc, _ in reqs]),
                block_table=bt, slot_mapping=slots, num_decodes=nd, device=dev,
            )  # fmt: skip
            kc = torch.randn(8, total, BLOCK_SIZE, 128, device=dev).to(dtype)
            vc = torch.randn_like(kc)
            q = torch.randn(md.num_tokens, 32, 128, device=dev).to(dtype)
            out = ta.paged_attention(q, kc, vc, md, 128**-0.5)
            ref = ta.paged_attention_ref(q, kc, vc, md, 128**-0.5)
            err = (out.float() - ref.float()).abs().max().item()
            ms = _time_cuda(lambda q=q, kc=kc, vc=vc, md=md: ta.paged_attention(q, kc, vc, md, 0.1))
            status = "ok" if err < 3e-2 else "FAIL"
            record(
                args.results,
                "triton",
                f"paged {label} {name}",
                f"max err {err:.1e}, {ms * 1e3:.0f} us",
                status,
            )
        x = torch.randn(4096, 4096, device=dev).to(dtype)
        r = torch.randn_like(x)
        w = torch.randn(4096, device=dev).to(dtype)
        got, got_r = ta.rms_norm(x, w, 1e-5, r)
        want, want_r = ta.rms_norm_ref(x, w, 1e-5, r)
        err = (got.float() - want.float()).abs().max().item()
        ok = "ok" if err < 5e-2 and torch.equal(got_r, want_r) else "FAIL"
        ms = _time_cuda(lambda x=x, w=w, r=r: ta.rms_norm(x, w, 1e-5, r))
        record(
            args.results,
            "triton",
            f"rms_norm+residual 4096x4096 {name}",
            f"max err {err:.1e}, {ms * 1e3:.0f} us",
            ok,
        )
        # A real cache: cos and sin of angles, so |out| <= |q| * sqrt(2) as in the model.
        ang = torch.rand(8192, 64, device=dev) * (2 * math.pi)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        pos = torch.randint(0, 8192, (4096,), device=dev)
        qq = torch.randn(4096, 32, 128, device=dev).to(dtype)
        kk = torch.randn(4096, 8, 128, device=dev).to(dtype)
        wq, wk = ta.rotary_embedding_ref(pos, qq, kk, cos, sin)
        gq, gk = ta.rotary_embedding(pos, qq.clone(), kk.clone(), cos, sin)
        err = max((gq - wq).abs().max().item(), (gk - wk).abs().max().item())
        # One rounding apart at most: relative to the largest output, within 2 of the dtype's
        # ulps (bf16's is 2^-8 of the value, fp16's 2^-11).
        rel = err / max(wq.abs().max().item(), wk.abs().max().item())
        record(
            args.results,
            "triton",
            f"rotary 4096 tokens {name}",
            f"max err {err:.1e} ({rel:.1e} of the largest output)",
            "ok" if rel <= 2 * torch.finfo(dtype).eps else "FAIL",
        )
        kc = torch.zeros(8, 512, BLOCK_SIZE, 128, device=dev, dtype=dtype)
        vc = torch.zeros_like(kc)
        kc2, vc2 = kc.clone(), vc.clone()
        slots = torch.randperm(512 * BLOCK_SIZE, device=dev)[:4096]
        slots[::5] = -1
        ta.write_kv_cache(kk, kk, kc, vc, slots)
        ta.write_kv_cache_ref(kk, kk, kc2, vc2, slots)
        ok = torch.equal(kc, kc2) and torch.equal(vc, vc2)
        record(
            args.results,
            "triton",
            f"kv write 4096 tokens {name}",
            "exact" if ok else "MISMATCH",
            "ok" if ok else "FAIL",
        )


def _smollm2_dir(model: str | None) -> tuple[str | None, str]:
    if model:
        return model, "given"
    from vx.models_hub.resolve import default_cache_dir

    found = sorted(glob.glob(os.path.join(default_cache_dir(), "converted", "smollm2-135m*")))
    found = [d for d in found if os.path.exists(os.path.join(d, "config.json"))]
    return (found[0], "SmolLM2-135M-Instruct") if found else (None, "")


def cmd_make_model(args) -> None:
    """A random SmolLM2-shaped model (vocab cut to a small trained tokenizer) + tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models import make_tokenizer

    tok = make_tokenizer(vocab_size=512)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        architectures=["LlamaForCausalLM"], dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(args.dir)
    tok.save_pretrained(args.dir)
    print(args.dir)


def cmd_parity(args) -> None:
    from transformers import AutoModelForCausalLM

    from vx.gpu.model_runner import ModelRunner

    path, what = _smollm2_dir(args.model)
    if path is None:
        import tempfile

        path = tempfile.mkdtemp(prefix="vx-smollm2-random-")
        args.dir = path
        cmd_make_model(args)
        what = "random SmolLM2-shaped"
    new_tokens = 24
    prompts = [
        [1, 504, 3, 77, 12, 9, 305, 41],
        [1, 22, 33, 44, 55, 66, 77, 88, 99, 110, 121, 132, 143, 154, 165, 176, 187, 198, 209],
        [1, 7],
        [1] + [300 + (i * 7) % 150 for i in range(70)],
    ]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = [[t % hf.config.vocab_size for t in p] for p in prompts]
    want = []
    with torch.inference_mode():  # plain argmax with HF's own KV cache: no logits processors
        for p in prompts:
            out = hf(torch.tensor([p], device="cuda"), use_cache=True)
            toks = [int(out.logits[0, -1].argmax())]
            while len(toks) < new_tokens:
                tok = torch.tensor([[toks[-1]]], device="cuda")
                out = hf(tok, past_key_values=out.past_key_values, use_cache=True)
                toks.append(int(out.logits[0, -1].argmax()))
            want.append(toks)
    del hf
    for eager in (False, True):
        config = _runner_config(path, "float32", 256, 8, 64, eager=eager)
        runner = ModelRunner(config, device="cuda")
        runner.load_model()
        runner.initialize_kv_cache(64)
        d = Driver(runner, 64)
        ids = [f"r{i}" for i in range(len(prompts))]
        new = [d.add(r, p, len(p) + new_tokens + 1) for r, p in zip(ids, prompts, strict=True)]
        got = {r: [] for r in ids}
        out = d.step(new, {r: len(p) for r, p in zip(ids, prompts, strict=True)})
        for _ in range(new_tokens):
            for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True):
                got[r] += t
            if len(got[ids[0]]) == new_tokens:
                break
            out = d.step([], dict.fromkeys(ids, 1))
        same = sum(got[r] == w for r, w in zip(ids, want, strict=True))
        cg = runner.cuda_graphs
        mode = "eager" if eager else f"graphs ({cg.num_replays} replays)" if cg else "NO graphs"
        first = [
            next((j for j, (a, b) in enumerate(zip(got[r], w, strict=True)) if a != b), None)
            for r, w in zip(ids, want, strict=True)
        ]
        record(
            args.results, "parity", f"{what} fp32 greedy vs HF, {mode}",
            f"{same}/{len(prompts)} prompts x {new_tokens} tokens identical; first diffs {first}",
            "ok" if same == len(prompts) and (eager or cg) else "DIFF",
        )  # fmt: skip
        del runner
        torch.cuda.empty_cache()


def _llama8b_model():
    from transformers import LlamaConfig

    from vx.gpu.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    model = LlamaForCausalLM(cfg, dtype=torch.bfloat16, device=torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def _copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 4 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _time_cuda(lambda: b.copy_(a), reps=10)
    a = b = None  # free 8 GiB before the model comes
    return 2 * n / (ms / 1e3)


def cmd_decode(args) -> None:
    from vx.gpu.input_batch import InputBatch
    from vx.gpu.model_runner import ModelRunner
    from vx.gpu.sample.step_sampler import StepSampler

    bw = _copy_bandwidth()
    t0 = time.perf_counter()
    model = _llama8b_model()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = weight_bytes / bw * 1e3
    record(
        args.results, "decode", "weight-streaming floor",
        f"{weight_bytes / 1e9:.2f} GB / {bw / 1e12:.2f} TB/s copy = {floor_ms:.2f} ms "
        f"(random init {time.perf_counter() - t0:.1f} s)",
    )  # fmt: skip
    batches = (1, 8, 64, 256)
    ctx = 512
    cap = ctx + 2 * len(batches) * (args.steps + 4) + 8
    num_blocks = max(batches) * math.ceil(cap / BLOCK_SIZE) + 8
    max_model_len = 2048
    config = _runner_config("", "bfloat16", max_model_len, max(batches), num_blocks)
    runner = ModelRunner(config, device="cuda")
    # What load_model does, with the random model instead of a checkpoint.
    runner.model, runner.dtype, runner.max_model_len = model, torch.bfloat16, max_model_len
    runner.input_batch = InputBatch(
        max(batches), max_model_len, math.ceil(max_model_len / BLOCK_SIZE)
    )
    runner.sampling = StepSampler(model, runner.input_batch, runner.device)
    t0 = time.perf_counter()
    runner.initialize_kv_cache(num_blocks)  # allocates the pool, then captures the graphs
    graphs = runner.cuda_graphs
    n_graphs = len(graphs.graphs) if graphs else 0
    record(
        args.results,
        "decode",
        "KV init + graph capture",
        f"{n_graphs} graphs, {time.perf_counter() - t0:.1f} s",
    )
    d = Driver(runner, num_blocks)
    ids = [f"r{i}" for i in range(max(batches))]
    g = torch.Generator().manual_seed(0)
    new = [d.add(r, torch.randint(100, 120000, (ctx,), generator=g).tolist(), cap) for r in ids]
    per = 8192 // ctx
    t0 = time.perf_counter()
    for i in range(0, len(ids), per):  # prefill, 8,192 tokens a step
        d.step(new[i : i + per], dict.fromkeys(ids[i : i + per], ctx))
    torch.cuda.synchronize()
    pre_s = time.perf_counter() - t0
    record(
        args.results,
        "decode",
        f"prefill {len(ids)} x {ctx}",
        f"{len(ids) * ctx / pre_s:,.0f} tok/s",
    )
    for b in batches:
        res = {}
        for mode in ("eager", "graphs"):
            runner.cuda_graphs = None if mode == "eager" else graphs
            sched = dict.fromkeys(ids[:b], 1)
            for _ in range(3):
                d.step([], sched)
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                d.step([], sched)
                times.append(time.perf_counter() - t)
            res[mode] = statistics.median(times) * 1e3
        runner.cuda_graphs = graphs
        record(
            args.results, "decode", f"Llama-8B-shaped bf16 decode step b={b}",
            f"eager {res['eager']:.2f} ms, graphs {res['graphs']:.2f} ms "
            f"({res['graphs'] / floor_ms:.2f}x floor {floor_ms:.2f} ms; "
            f"{b / res['graphs'] * 1e3:,.0f} tok/s)",
        )  # fmt: skip


def cmd_serve_row(args) -> None:
    """One row from a `vx bench serve --json` file."""
    with open(args.json) as f:
        s = json.load(f)
    s = s[0] if isinstance(s, list) else s
    record(
        args.results, "serve", f"vx bench serve c={s['concurrency']} {args.label}",
        f"{s['completed']}/{s['num_prompts']} ok, {s['output_throughput']:,.0f} out tok/s, "
        f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, ITL p50 {s['itl_ms']['p50']:.1f} ms",
        "ok" if s["failed"] == 0 else "FAIL",
    )  # fmt: skip


def cmd_table(args) -> None:
    rows = []
    if os.path.exists(args.results):
        with open(args.results) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    w = max([len(r["check"]) for r in rows] + [10])
    print("\n" + "=" * (w + 60))
    print(f"{'section':<8} {'check':<{w}} {'status':<6} result")
    print("-" * (w + 60))
    for r in rows:
        print(f"{r['section']:<8} {r['check']:<{w}} {r['status']:<6} {r['result']}")
    print("=" * (w + 60))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("env", "triton", "parity", "decode", "table"):
        p = sub.add_parser(name)
        p.add_argument("--results", required=True)
        if name == "parity":
            p.add_argument("--model", default=None)
        if name == "decode":
            p.add_argument("--steps", type=int, default=20)
    p = sub.add_parser("serve-row")
    p.add_argument("--results", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--label", default="")
    p = sub.add_parser("make-model")
    p.add_argument("dir")
    args = ap.parse_args()
    {
        "env": cmd_env, "triton": cmd_triton, "parity": cmd_parity, "decode": cmd_decode,
        "table": cmd_table, "make-model": cmd_make_model, "serve-row": cmd_serve_row,
    }[args.cmd](args)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
