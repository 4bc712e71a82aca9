"""Serve the same model with vx and its peers, one after the other, under the same load.

Usage:
    python bench/compare.py [--peers vllm,llamacpp,llamacpp-q4_1] [--concurrency 1,8,32,64]
        [--repeats 1] [--vx-variant 'int8=--quantization int8']

For each server: start it, wait for /ready (or /health), run `vx bench serve` (streaming /v1/completions,
random token-id prompts of --input-len tokens, --output-len tokens with ignore_eos, greedy) at
each concurrency, stop it. With --interleave every server is up for the whole run (each on its
own port, paused with SIGSTOP while another is measured) and each concurrency is measured on every server in
turn, the order reversed from one concurrency to the next: the machine's speed drifts by tens
of percent over a run, and this puts each ratio's two figures minutes, not half a run, apart. Prints one table with vx's ratio to each peer per concurrency and
writes the raw figures as JSON (--json). The peers are set up by `shared/peers/peers.sh`
(`vllm-setup`, `setup`); a peer that is not set up is skipped with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from idle_cpu import tree  # bench/ is this script's directory

ROOT = pathlib.Path(__file__).resolve().parents[1]
PEERS_SH = pathlib.Path(os.environ.get("VX_PEERS_SH", ROOT.parent / "shared/peers/peers.sh"))
PEER_DIR = pathlib.Path(
    os.environ.get("PEER_DIR", pathlib.Path.home() / ".cache/vx-peers")
)


def wait_health(url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            # vx answers /health while it loads and /ready once it serves; peers without
            # /ready (404) answer /health only once they serve.
            status = httpx.get(url + "/ready", timeout=2).status_code
            if status == 404:
                status = httpx.get(url + "/health", timeout=2).status_code
            if status == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def _spec_counts(url: str) -> tuple[float, float]:
    """A vx server's drafts and accepted drafts so far (/metrics); (0, 0) for another."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0, 0.0
    sums = {"vx:spec_decode_num_draft_tokens_total": 0.0,
            "vx:spec_decode_num_accepted_tokens_total": 0.0}  # fmt: skip
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[-1])
    return tuple(sums.values())  # type: ignore[return-value]


def run_load(url: str, model: str, conc: int, args: argparse.Namespace, seed: int = 0) -> dict:
    """One `vx bench serve` run. Each (concurrency, repeat) has its own seed, so no level
    reuses another's prompts (a reused prompt is a prefix-cache hit, not the workload)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    num_prompts = max(conc * args.prompts_per_client, args.min_prompts)
    cmd = [
        sys.executable, "-m", "vx", "bench", "serve",
        "--base-url", url, "--model", model,
        "--concurrency", str(conc), "--num-prompts", str(num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--prompt-kind", args.prompt_kind, "--seed", str(seed), "--json", out,
        "--temperature", str(args.temperature),
    ]
    before = _spec_counts(url)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    after = _spec_counts(url)
    if after[0] > before[0]:  # a vx server with speculative decoding: its drafts in this run
        result["spec_draft_tokens"] = after[0] - before[0]
        result["spec_accepted_tokens"] = after[1] - before[1]
    if os.path.isabs(result.get("model") or ""):  # a server's local file (llama.cpp's GGUF)
        result["model"] = os.path.basename(result["model"])
    return result


class Server:
    """A server started for the run and stopped after it."""

    def __init__(self, name: str, url: str, model: str, start: list[str], stop: list[str] | None,
                 env: dict[str, str] | None = None, pidfile: pathlib.Path | None = None) -> None:
        self.name, self.url, self.model = name, url, model
        self._start, self._stop, self._env = start, stop, env
        self._proc: subprocess.Popen | None = None
        self._pidfile = pidfile

    def pause(self, paused: bool) -> None:
        """SIGSTOP (or SIGCONT) the server's whole process tree: an idle server left running
        can still poll (vLLM's idles at ~12% of this machine), which the measured one pays."""
        root = self._proc.pid if self._proc is not None else None
        if root is None and self._pidfile is not None and self._pidfile.exists():
            root = int(self._pidfile.read_text().split()[0])
        if root is None:
            return
        for pid in tree(root):  # bench/idle_cpu.py's: the root and its descendants
            try:
                os.kill(pid, signal.SIGSTOP if paused else signal.SIGCONT)
            except ProcessLookupError:
                pass

    def __enter__(self) -> Server:
        env = dict(os.environ, **(self._env or {}))
        if self._stop is None:  # a foreground process we own
            self._proc = subprocess.Popen(self._start, env=env, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            subprocess.run(self._start, env=env, check=True, stdout=subprocess.DEVNULL)
        wait_health(self.url, self._proc, 900)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if self._stop is not None:
            # The same environment as the start: the stop finds its pid file by port.
            env = dict(os.environ, **(self._env or {}))
            subprocess.run(self._stop, env=env, check=False, stdout=subprocess.DEVNULL)
            # The stop scripts only signal: wait until the port is free before the next server.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    httpx.get(self.url + "/health", timeout=1)
                except httpx.HTTPError:
                    break
                time.sleep(1)


def servers(args: argparse.Namespace) -> list[Server]:
    vx_port, vllm_port, llama_port = 8100, 8101, 8102
    def vx_cmd(port: int) -> list[str]:
        return [sys.executable, "-m", "vx", "serve", args.model, "--port", str(port),
                "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "64"]

    # the served name is asked of each server (/v1/models): it follows --model
    out = [Server("vx", f"http://127.0.0.1:{vx_port}", "",
                  vx_cmd(vx_port) + args.vx_args.split(), None)]
    for i, variant in enumerate(args.vx_variant):
        name, _, extra = variant.partition("=")
        port = vx_port + 3 + i if args.interleave else vx_port  # all up at once: own ports
        # NAME=VALUE words with an upper-case NAME are the server's environment, not flags
        words = extra.split()
        env = dict(w.split("=", 1) for w in words if w.split("=", 1)[0].isupper())
        flags = [w for w in words if not w.split("=", 1)[0].isupper()]
        # --vx-args go to every vx server (a smaller KV pool keeps several up within memory)
        out.append(Server(f"vx {name}", f"http://127.0.0.1:{port}", "",
                          vx_cmd(port) + args.vx_args.split() + flags, None, env or None))
    peers = [p for p in args.peers.split(",") if p]
    if "vllm" in peers:
        if (PEER_DIR / "vllmcpu/bin/python").exists():
            # the model vLLM serves is peers.sh's HF_MODEL: the one compared, not its default
            env = {"VLLM_PORT": str(vllm_port), "HF_MODEL": os.path.abspath(args.model)}
            out.append(Server("vLLM", f"http://127.0.0.1:{vllm_port}", "",
                              ["bash", str(PEERS_SH), "vllm-start"],
                              ["bash", str(PEERS_SH), "vllm-stop"], env,
                              PEER_DIR / f"vllm.{vllm_port}.pid"))
        else:
            print("vLLM peer not set up (peers.sh vllm-setup); skipping", file=sys.stderr)
    variants = [v for v, name in (("bf16", "llamacpp"), ("q4_1", "llamacpp-q4_1")) if name in peers]
    if variants:
        if (PEER_DIR / "llamabin/bin/python").exists():
            env = {"PORT": str(llama_port)}
            for variant in variants:
                out.append(Server(f"llama.cpp {variant}", f"http://127.0.0.1:{llama_port}", "",
                                  ["bash", str(PEERS_SH), "start", variant],
                                  ["bash", str(PEERS_SH), "stop"], env,
                                  PEER_DIR / f"llama-server.{llama_port}.pid"))
        else:
            print("llama.cpp peer not built (peers.sh setup); skipping", file=sys.stderr)
    return out


def served_model(url: str) -> str:
    data = httpx.get(url + "/v1/models", timeout=10).json()
    return data["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--peers", default="vllm")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-kind", choices=["ids", "words", "copy"], default="ids",
                   help="`vx bench serve --prompt-kind` (copy: speculative decoding's workload)")
    p.add_argument("--temperature", type=float, default=0.0, help="`vx bench serve --temperature`")
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warmup-concurrency", default="8,32,64", metavar="C,C",
                   help="besides c = 1, warm each server up once at these (not counted; '' none)")
    p.add_argument("--vx-args", default="", help="extra flags for every vx server")
    p.add_argument("--vx-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="also run vx with these extra flags, as 'vx NAME' (repeatable), "
                        "e.g. 'int8=--quantization int8'; upper-case NAME=VALUE words "
                        "set its environment, e.g. 'static=VX_CPU_WORK_STEALING=0'")
    p.add_argument("--peers-first", action="store_true",
                   help="run the peers before vx (default: vx first)")
    p.add_argument("--interleave", action="store_true",
                   help="all servers up at once; each concurrency on each server in turn")
    p.add_argument("--json", default=None, help="write all figures here")
    p.add_argument("--from-json", default=None, help="no load: report and plot a saved run")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="throughput, TTFT and ITL against concurrency, one line per server")
    args = p.parse_args(argv)
    if args.interleave and {"llamacpp", "llamacpp-q4_1"} <= set(args.peers.split(",")):
        # peers.sh keeps one llama-server (one pid file): interleaved, one variant a run
        p.error("--interleave takes one llama.cpp variant: llamacpp or llamacpp-q4_1")
    concs = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, dict[int, list[dict]]] = {}
    if args.from_json:
        with open(args.from_json) as f:
            results = {k: {int(c): v for c, v in d.items()} for k, d in json.load(f).items()}
        concs = sorted({c for d in results.values() for c in d})
    order = [] if args.from_json else servers(args)
    if args.peers_first:  # the other order, to see how much drift during a run moves ratios
        order = [s for s in order if not s.name.startswith("vx")] + [
            s for s in order if s.name.startswith("vx")
        ]
    if args.interleave and order:
        run_interleaved(order, concs, args, results)
        order = []
    for server in order:
        if args.json:  # what is measured so far survives a later server's failure
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        with server:
            model = server.model or served_model(server.url)
            warm_up(server.url, model, args)
            for conc in concs:
                for rep in range(args.repeats):
                    r = run_load(server.url, model, conc, args, _seed(conc, rep))
                    results.setdefault(server.name, {}).setdefault(conc, []).append(r)
                    print(f"{server.name} c={conc}: {r['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms, ITL p50 {r['itl_ms']['p50']:.1f} ms",
                          file=sys.stderr)
    print_table(results, concs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot_comparison(results, concs, args.plot)
    return 0


def run_interleaved(order: list[Server], concs: list[int], args: argparse.Namespace,
                    results: dict[str, dict[int, list[dict]]]) -> None:
    """Every server up at once; each (repeat, concurrency) measured on each in turn, the
    order reversed every time, so drift between the two figures of a ratio stays small."""
    with contextlib.ExitStack() as stack:
        models = {}
        for server in order:
            stack.enter_context(server)
            # continued before it is stopped (a stopped process holds its SIGTERM)
            stack.callback(server.pause, False)
            models[server.name] = server.model or served_model(server.url)
            warm_up(server.url, models[server.name], args)
        busy = _machine_busy(5.0)
        for server in order:
            server.pause(True)
        paused = _machine_busy(5.0)
        print(f"all {len(order)} servers idle: {busy:.1%} of the machine busy; "
              f"paused (SIGSTOP, as while another is measured): {paused:.1%}", file=sys.stderr)
        turn = 0
        for rep in range(args.repeats):
            for conc in concs:
                for server in order if turn % 2 == 0 else order[::-1]:
                    server.pause(False)
                    try:
                        r = run_load(server.url, models[server.name], conc, args,
                                     _seed(conc, rep))
                    finally:
                        server.pause(True)
                    results.setdefault(server.name, {}).setdefault(conc, []).append(r)
                    spec = ""
                    if r.get("spec_draft_tokens"):
                        spec = (f", drafts accepted {r['spec_accepted_tokens']:.0f} of "
                                f"{r['spec_draft_tokens']:.0f}")
                    print(f"{server.name} c={conc}: {r['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
                          f"ITL p50 {r['itl_ms']['p50']:.1f} ms{spec}", file=sys.stderr)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump(results, f, indent=1)
                turn += 1


def _seed(conc: int, rep: int) -> int:
    """The prompts' seed of one (concurrency, repeat); 0 and 500 + c are the warm-up's."""
    return 1000 * (rep + 1) + conc


def warm_up(url: str, model: str, args: argparse.Namespace) -> None:
    """One pass at c = 1, then one at each --warmup-concurrency level, none of them counted:
    a server's first run at a new batch size pays one-time costs (vLLM's CPU build ran its
    first c = 32 and c = 64 passes at 0.65-0.8x the speed of the next, vx within noise), which
    belong to start-up, not to the steady state the ratios compare."""
    run_load(url, model, 1, args)
    for conc in (int(c) for c in args.warmup_concurrency.split(",") if c):
        run_load(url, model, conc, args, 500 + conc)


def _machine_busy(seconds: float) -> float:
    """Share of all CPUs' time not idle over `seconds` (from /proc/stat)."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    t0, i0 = snap()
    time.sleep(seconds)
    t1, i1 = snap()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


def plot_comparison(results: dict[str, dict[int, list[dict]]], concs: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_throughput", None, "output tok/s"), ("ttft_ms", "p50", "TTFT p50 (ms)"),
              ("itl_ms", "p50", "ITL p50 (ms)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), constrained_layout=True)
    for ax, (key, sub, label) in zip(axes, panels, strict=True):
        for name, by_conc in results.items():
            xs = [c for c in concs if by_conc.get(c)]
            ys = [_median(by_conc[c], key, sub) for c in xs]
            ax.plot(xs, ys, marker="o", linewidth=2, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_title(label, loc="left", fontweight="bold")
        ax.grid(True, alpha=0.3)
    axes[0].legend(frameon=False)
    fig.suptitle("SmolLM2-135M bf16, 128-token prompts, 128 output tokens, streaming, 2 CPU cores",
                 fontsize=10)
    fig.savefig(path, dpi=110)


def _median(rows: list[dict], key: str, sub: str | None = None) -> float:
    vals = [r[key][sub] if sub else r[key] for r in rows]
    return statistics.median(vals)


def print_table(results: dict[str, dict[int, list[dict]]], concs: list[int]) -> None:
    names = list(results)
    print("\n| server | " + " | ".join(f"c={c}" for c in concs) + " |")
    print("|---|" + "---:|" * len(concs))
    for name in names:
        cells = []
        for c in concs:
            rows = results[name].get(c, [])
            if not rows:
                cells.append("—")
                continue
            cells.append(
                f"{_median(rows, 'output_throughput'):.1f} tok/s "
                f"({_median(rows, 'ttft_ms', 'p50'):.0f} / {_median(rows, 'itl_ms', 'p50'):.1f} ms)"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")
    ours = [n for n in names if n == "vx" or n.startswith("vx ")]
    for mine in ours:
        for name in (n for n in names if n not in ours):
            cells = []
            for c in concs:
                a, b = results[mine].get(c), results[name].get(c)
                if not a or not b:
                    cells.append("—")
                    continue
                tput = _median(a, "output_throughput") / _median(b, "output_throughput")
                ttft = _median(a, "ttft_ms", "p50") / _median(b, "ttft_ms", "p50")
                cells.append(f"{tput:.2f}× tok/s, TTFT {ttft:.2f}×")
            print(f"| {mine} / {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
