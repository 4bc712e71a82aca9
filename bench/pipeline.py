"""Pipeline-parallel overhead on one machine: PP = 2 as two "nodes" of one core each against
TP = 1 on one core, with a random Llama-1B-shaped bf16 model, and each stage's bubble over
exactly each load phase.

Usage:
    python bench/pipeline.py --model DIR [--make] [--mode pp|tp1] [--partition 10,6]
        [--hand-off off|N] [--shift N]
        [--concurrency 8,32] [--num-prompts 64,128] [--input-len 64] [--output-len 32]
        [--serve-args '--max-num-batched-tokens 80'] [--period 12]

`--make` first writes the model to DIR (16 layers, hidden 2,048, 32 / 8 heads, intermediate
8,192, a tied 128,256-token head: Llama-3.2-1B's shapes; SmolLM2-135M's tokenizer, which skips
the ids it lacks). PP: node 0 (`taskset -c 0`: front, EngineCore, stage 0) and node 1
(`taskset -c 1`, `--headless`: stage 1, the driver) over 127.0.0.1; TP = 1 runs on core 0.
The client (`vx bench serve`: one warm-up request, then one run per concurrency with no
warm-up of its own, each 1.5 s apart so that each is a busy period of its own) runs on core 1 (beside
stage 1, which waits more than stage 0: node 0's core also runs the front and the EngineCore).

With `--profile-steps` each stage logs one line per busy period (`vx/gpu/worker.py`,
`_StageProfile`), so the lines after the start-up are the phases, in order; this prints each
phase's output tok/s and, for PP, each stage's compute / wait-on-previous / idle shares.
`--period N` makes each stage log every N steps (`VX_PP_PROFILE_STEPS`) and prints the stages'
lines side by side instead, in order: how the bubble moves between a load phase's prompt-heavy
and decode-only stretches.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

STAGE_LINE = re.compile(
    r"pp stage (\d+) profile over (\d+) steps \(([\d.]+) s\): compute ([\d.]+)%, waiting on the "
    r"stage before ([\d.]+)%, waiting for steps ([\d.]+)% \(bubble ([\d.]+)%\); step "
    r"delivery ([\d.]+) ms"
)


def make_model(path: str) -> None:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vx.models_hub.resolve import resolve_model

    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=1, eos_token_id=2,
        architectures=["LlamaForCausalLM"], dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    src = resolve_model("smollm2-135m")
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(src, name), path)


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)  # polling a starting server: no event to wait on
    raise TimeoutError("server not ready")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--make", action="store_true", help="write the random model first")
    ap.add_argument("--mode", choices=["pp", "tp1"], default="pp")
    ap.add_argument("--partition", default=None, help="VX_PP_LAYER_PARTITION (default: vx's)")
    ap.add_argument("--hand-off", default=None,
                    help="VX_PP_HAND_OFF_TOKENS (default: vx's; 'off': never)")
    ap.add_argument("--shift", default=None,
                    help="VX_PP_SHIFT_LAYERS (default: vx's; 0: the boundary stays)")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--num-prompts", default="64",
                    help="per concurrency, or one count for all (e.g. 64,128)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--serve-args", default="",
                    help="more `vx serve` arguments for every node, "
                         "e.g. '--max-num-batched-tokens 80'")
    ap.add_argument("--period", type=int, default=None,
                    help="steps per stage profile line (VX_PP_PROFILE_STEPS); prints them all")
    args = ap.parse_args()
    if args.make and not os.path.exists(os.path.join(args.model, "config.json")):
        make_model(args.model)
    py = sys.executable
    env = {**os.environ, "VX_CPU_ROW_PLAN": "0"}
    if args.partition:
        env["VX_PP_LAYER_PARTITION"] = args.partition
    if args.hand_off is not None:
        env["VX_PP_HAND_OFF_TOKENS"] = "" if args.hand_off == "off" else args.hand_off
    if args.shift is not None:
        env["VX_PP_SHIFT_LAYERS"] = args.shift
    if args.period:
        env["VX_PP_PROFILE_STEPS"] = str(args.period)
    serve = [py, "-m", "vx", "serve", args.model, "--num-threads", "1", "--profile-steps",
             *shlex.split(args.serve_args)]
    logs = [tempfile.NamedTemporaryFile("w+b", suffix=f"-node{i}.log") for i in range(2)]
    procs: list[subprocess.Popen] = []
    url = f"http://127.0.0.1:{args.port}"
    try:
        if args.mode == "pp":
            nodes = ["-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                     "--master-port", str(args.port + 10)]  # fmt: skip
            procs.append(subprocess.Popen(
                ["taskset", "-c", "1", *serve, *nodes, "--node-rank", "1", "--headless"],
                stdout=logs[1], stderr=subprocess.STDOUT, env=env,
            ))  # fmt: skip
            node0 = [*nodes, "--node-rank", "0"]
        else:
            node0 = []
        procs.insert(0, subprocess.Popen(
            ["taskset", "-c", "0", *serve, *node0, "--port", str(args.port)],
            stdout=logs[0], stderr=subprocess.STDOUT, env=env,
        ))  # fmt: skip
        _wait_ready(url, procs[0], 600)
        # One unmeasured request first, in its own busy period: inside a phase's, its steps of
        # one request (one step in flight) would count in that phase's bubble.
        bench = [py, "-m", "vx", "bench", "serve", "--base-url", url, "--input-len",
                 str(args.input_len), "--output-len", str(args.output_len), "--warmup", "0"]
        subprocess.run(["taskset", "-c", "1", *bench, "--concurrency", "1", "--num-prompts", "1"],
                       check=True, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)  # fmt: skip
        time.sleep(1.5)  # an idle gap: the warm-up's busy period closes
        results = []
        levels = [int(x) for x in args.concurrency.split(",")]
        counts = [int(x) for x in args.num_prompts.split(",")]
        counts = counts * len(levels) if len(counts) == 1 else counts
        for c, n in zip(levels, counts, strict=True):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run(
                    ["taskset", "-c", "1", *bench, "--concurrency", str(c), "--num-prompts",
                     str(n), "--json", out.name],
                    check=True, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL,
                )  # fmt: skip
                results.append((c, n, json.load(open(out.name))))
            time.sleep(1.5)  # an idle gap, so that each stage closes this phase's busy period
    finally:
        if procs and procs[0].poll() is None:
            procs[0].send_signal(signal.SIGINT)  # a clean shutdown flushes the last period
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    stage_lines: dict[int, list[tuple[float, ...]]] = {}
    engine_lines: list[str] = []
    for log in logs:
        log.seek(0)
        text = log.read().decode(errors="replace")
        engine_lines += re.findall(r"engine_core: (profile over \d+ steps \(.*)", text)
        for m in STAGE_LINE.finditer(text):
            stage_lines.setdefault(int(m[1]), []).append(tuple(float(x) for x in m.groups()[1:]))
        log.close()
    print(f"mode {args.mode}, partition {args.partition or 'default'}, hand-off "
          f"{args.hand_off or 'default'}, shift {args.shift or 'default'}, "
          f"({args.input_len} in, {args.output_len} out) {args.serve_args}")  # fmt: skip
    for i, (c, n, res) in enumerate(results):
        row = res[0] if isinstance(res, list) else res
        print(f"c = {c}, {n} prompts: output {row['output_throughput']:.1f} tok/s, TTFT p50 "
              f"{row['ttft_ms']['p50']:.0f} ms, ITL p50 {row['itl_ms']['p50']:.0f} ms")
        for stage, lines in [] if args.period else sorted(stage_lines.items()):
            phase = lines[len(lines) - len(results) + i]  # the last lines are the phases
            steps, wall, comp, wait_prev, idle, bubble, delivery = phase
            print(f"  stage {stage}: {int(steps)} steps over {wall:.1f} s: compute {comp:.1f}%, "
                  f"waiting on the stage before {wait_prev:.1f}%, waiting for steps "
                  f"{idle:.1f}% (bubble {bubble:.1f}%); step delivery {delivery:.2f} ms, "
                  f"{1e3 * wall * comp / 100 / steps:.1f} ms of compute a step")  # fmt: skip
    if args.period and len(stage_lines) == 2:
        print("stage 0 | stage 1, every line: steps, seconds, compute %, bubble %")
        for a, b in zip(stage_lines[0], stage_lines[1], strict=False):
            print(f"  {int(a[0]):4d} {a[1]:6.2f} s {a[2]:5.1f} {a[5]:5.1f} | "
                  f"{int(b[0]):4d} {b[1]:6.2f} s {b[2]:5.1f} {b[5]:5.1f}")
    for line in engine_lines[-4:]:  # the EngineCore's own lines, every 200 steps
        print(f"  EngineCore {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
