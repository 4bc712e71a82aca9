"""Offline throughput: `vx.LLM` against HF transformers' static-batch `generate` and vLLM's `LLM`.

Usage:
    flock /tmp/vx-bench.lock python bench/offline.py [--batch 64] [--input-len 128] [--output-len 128]

All three run one after the other in this run, on the same random token-id prompts, greedy
with ignore_eos, bf16. vLLM runs in its own venv (`shared/peers/peers.sh vllm-setup`) as a
subprocess; it is skipped with a message when that venv is missing. Prints output tok/s and
vx's ratio to each.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import subprocess
import sys
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEER_DIR = pathlib.Path(os.environ.get("PEER_DIR", pathlib.Path.home() / ".cache/vx-peers"))
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", str(PEER_DIR / "vllmcpu/bin/python"))


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def bench_vx(path: str, prompts: list[list[int]], output_len: int, batch: int) -> float:
    import vx

    with vx.LLM(path, dtype="bfloat16", max_num_seqs=batch, max_model_len=2048) as llm:
        sp = vx.SamplingParams.create(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:2], vx.SamplingParams.create(max_tokens=4), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return len(prompts) * output_len / dt


def bench_hf(path: str, prompts: list[list[int]], output_len: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    with torch.inference_mode():
        model.generate(ids[:2, :8], max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + output_len
    return len(prompts) * output_len / dt


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM, SamplingParams
    path, prompts_file, output_len, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    prompts = json.load(open(prompts_file))
    llm = LLM(model=path, dtype="bfloat16", max_model_len=2048, max_num_seqs=batch)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    print("RESULT", len(prompts) * output_len / dt)
    """
)


def bench_vllm(path: str, prompts: list[list[int]], output_len: int, batch: int) -> float | None:
    if not os.path.exists(VLLM_PYTHON):
        print(f"vLLM venv not found ({VLLM_PYTHON}); skipping vLLM", file=sys.stderr)
        return None
    tmp = pathlib.Path("/tmp/vx-offline-prompts.json")
    tmp.write_text(json.dumps(prompts))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND="0-1")
    out = subprocess.run(
        [VLLM_PYTHON, "-c", VLLM_SCRIPT, path, str(tmp), str(output_len), str(batch)],
        capture_output=True, text=True, env=env, timeout=1800,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT"):
            return float(line.split()[1])
    print(out.stderr[-3000:], file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--skip", default="", help="comma list of hf,vllm to skip")
    args = p.parse_args(argv)
    from vx.models_hub.resolve import resolve_model

    path = resolve_model(args.model)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts = make_prompts(args.batch, args.input_len, vocab)
    skip = set(args.skip.split(","))
    rows = {"vx.LLM": bench_vx(path, prompts, args.output_len, args.batch)}
    if "hf" not in skip:
        rows["HF generate"] = bench_hf(path, prompts, args.output_len)
    if "vllm" not in skip:
        hf_dir = os.environ.get("VX_VLLM_MODEL", str(PEER_DIR / "models/smollm2-135m-hf"))
        v = bench_vllm(hf_dir if os.path.isdir(hf_dir) else path, prompts, args.output_len, args.batch)
        if v is not None:
            rows["vLLM LLM"] = v
    print(f"\nbatch {args.batch} × ({args.input_len} + {args.output_len}) tokens, bf16, greedy")
    print("| engine | output tok/s | vx ratio |\n|---|---:|---:|")
    for name, tput in rows.items():
        print(f"| {name} | {tput:.1f} | {rows['vx.LLM'] / tput:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
