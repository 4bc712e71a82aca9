"""Every environment variable vx reads, declared once: its type, its default and what it does.

Runs in: every process (it imports the standard library only). `envs.VX_LOG_LEVEL` reads the
environment when it is accessed (module-level `__getattr__`, as in vLLM's `vllm/envs.py`), so a
test's `monkeypatch.setenv` is seen by the next read. A module that wants a value fixed for its
life reads it once and keeps the result.

Invariants (tests/test_envs.py checks them): code under vx/ reads the environment only through
this module (writing it, for a child process, is fine); every `VX_*` name in vx/, bench/,
tests/, README.md and docs/ is declared in `ENV_VARS` (or is a C macro of the kernel sources);
docs/configuration.md is `markdown()`, regenerated with
``python -m vx.envs --markdown > docs/configuration.md``.

Each entry also says who sets the variable (`set_by`): an operator, or the test or bench script
that needs it. A/B switches for experiments that are over are removed, not kept here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ENV_VARS", "EnvVar", "export", "markdown"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvVar:
    """One environment variable: `read()` is `parse(value)` when it is set, else the default
    (`default`, or `default_factory()` for one computed at read time)."""

    name: str
    #: what the value is, as docs/configuration.md shows it
    type: str
    parse: Callable[[str], Any]
    default: Any = None
    default_factory: Callable[[], Any] | None = None
    #: the default as docs/configuration.md shows it
    shown_default: str
    #: one line: what it does, and its values
    doc: str
    #: who sets it, so why it is kept: "operator", or the tests / bench scripts that need it
    set_by: str
    #: where it is read: "vx", or the scripts that read it (not vx's package)
    read_in: str = "vx"
    #: a name vx did not invent (a compiler's, Hugging Face's, CUDA's, Triton's)
    external: bool = False

    def read(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default_factory() if self.default_factory is not None else self.default
        return self.parse(raw)


def _on_unless_0(value: str) -> bool:
    return value != "0"


def _on_if_1(value: str) -> bool:
    return value == "1"


def _int_or_none(value: str) -> int | None:
    return int(value) if value else None


def _hf_true(value: str) -> bool:
    return value.upper() in ("1", "ON", "YES", "TRUE")


def _home_cache() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "vx")


def _switch(name: str, doc: str, set_by: str, **kw: Any) -> EnvVar:
    """A switch that is on unless its value is "0"."""
    return EnvVar(name=name, type="switch (0: off)", parse=_on_unless_0, default=True,
                  shown_default="1", doc=doc, set_by=set_by, **kw)  # fmt: skip


def _text(name: str, default: str, doc: str, set_by: str, **kw: Any) -> EnvVar:
    return EnvVar(name=name, type="string", parse=str, default=default,
                  shown_default=f"`{default}`" if default else "empty", doc=doc, set_by=set_by,
                  **kw)  # fmt: skip


# NOTE: keep the entries grouped as docs/configuration.md shows them: the operator's settings,
# the CPU path's switches for tests, the names vx did not invent, then tests' and bench's own.
ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    # ── settings for an operator ──
    _text("VX_LOG_LEVEL", "INFO",
          "Log level of every process (`vx serve --log-level` sets it for the children).",
          "operator; vx itself, for its child processes"),
    _text("VX_LOG_FORMAT", "text",
          "Log line format of every process: `text`, or `json` (one object a line; "
          "`vx serve --log-format` sets it for the children).",
          "operator; vx itself, for its child processes"),
    EnvVar(name="VX_LOG_REQUESTS", type="flag (1: on)", parse=_on_if_1, default=False,
           shown_default="0",
           doc="Log each request's admission, first token and finish at INFO, with its prompt "
               "in the front (`vx serve --enable-log-requests` sets it for the children).",
           set_by="operator; vx itself, for its child processes"),
    EnvVar(name="VX_SERVER_DEV_MODE", type="flag (1: on)", parse=_on_if_1, default=False,
           shown_default="0",
           doc="Serve the development endpoints (vLLM's `VLLM_SERVER_DEV_MODE`): `POST "
               "/reset_prefix_cache`. Not for production: anyone who can reach the port can "
               "drop every engine's prefix cache.",
           set_by="operator; tests/core/test_kv_events.py"),
    _text("VX_HOST_CPUS", "auto",
          "Cores for the front and EngineCore processes: `auto` (on CPU the last allowed core), "
          "a list such as `0,2-3`, or `off`/`none`/empty to leave them where they are.",
          "operator"),
    _text("VX_PP_LAYER_PARTITION", "",
          "Layers per pipeline stage, e.g. `10,6` (vLLM's `VLLM_PP_LAYER_PARTITION`; the same on "
          "every node); empty: vx's split, which counts the last stage's LM head as layers (an "
          "even split for MoE models).",
          "operator"),
    EnvVar(name="VX_PP_PROFILE_STEPS", type="integer", parse=int, default=2000,
           shown_default="`2000`",
           doc="Pipeline parallel with `--profile-steps`: the most steps one profile line of a "
               "stage covers (a smaller count shows how the bubble moves within a load phase).",
           set_by="bench/pipeline.py (`--period`)"),
    EnvVar(name="VX_PP_HAND_OFF_TOKENS", type="integer", parse=_int_or_none, default=1,
           shown_default="`1`",
           doc="Pipeline parallel: a step with at least this many prompt tokens has each stage "
               "but the last stop its last layer after the attention, and the next stage, "
               "which holds a copy of that layer's o_proj, norm and MLP, finishes it (`0`: "
               "every step; empty: never, and no copy; the same on every node).",
           set_by="operator; tests (test_llm, test_pp_hand_off), bench/pipeline.py"),
    EnvVar(name="VX_PP_SHIFT_LAYERS", type="integer", parse=int, default=1,
           shown_default="`1`",
           doc="Pipeline parallel: on a step that hands off (`VX_PP_HAND_OFF_TOKENS`), each "
               "stage but the last stops this many layers earlier, and the next stage, which "
               "holds those layers and their KV cache too, runs them; the two copies of their "
               "K/V are kept alike (at most the stage's layers less one; `0`: the boundary "
               "stays; the same on every node).",
           set_by="operator; tests (test_llm, test_pp_hand_off), bench/pipeline.py"),
    EnvVar(name="VX_CACHE", type="path", parse=lambda s: s or _home_cache(),
           default_factory=_home_cache, shown_default="`~/.cache/vx`",
           doc="Where vx keeps converted models and the built C kernel library.",
           set_by="operator; tests (test_kernel_library, test_kernel_targets, test_model_parity), "
                  "bench/gpu_check.sh"),
    EnvVar(name="VX_CPU_WIDEN_BUDGET", type="bytes", parse=_int_or_none,
           shown_default="a quarter of physical memory",
           doc="Bytes of widened weight copies one Worker makes on a CPU without bf16 arithmetic "
               "(panels, fp32 or compact copies); the layers past it run bf16 GEMMs.",
           set_by="operator; tests/gpu/cpu/test_widen.py"),
    _switch("VX_CPU_BIND_THREADS",
            "Bind the CPU Worker's OpenMP threads one per core where they are as many as the "
            "allowed cores; `0` leaves the threads free (e.g. beside other work).",
            "operator"),
    _switch("VX_CPU_MALLOC_TUNING",
            "On CPU, glibc's malloc keeps freed memory for the next step (RSS stays at its peak); "
            "`0` leaves malloc alone.",
            "operator; tests/gpu/test_worker_settle.py"),
    _switch("VX_CPU_HUGE_PAGES",
            "Put the CPU weights and KV cache in 2 MiB pages (`MADV_COLLAPSE`, `MADV_HUGEPAGE`); "
            "`0`: plain pages.",
            "operator; tests/gpu/cpu/test_pages.py"),
    _switch("VX_CPU_PREPACK",
            "oneDNN's prepacked bf16 GEMM and the VNNI-packed copies for CPU linears; `0`: plain "
            "weights and `F.linear` (e.g. to trace the model with torch.compile).",
            "operator; tests/gpu/test_model_parity.py"),
    _text("VX_CPU_ATTENTION_KERNEL", "fast",
          "`0`: no C kernel library at all (torch's ops on every CPU path); `portable`: the "
          "library, with the portable decode attention kernel and SDPA for prefill chunks; "
          "anything else (`fast`): the library, with the fastest attention kernels the CPU has.",
          "operator; tests (test_fast_attention, test_kernel_library, test_emulated_isa)"),
    # ── the CPU path's switches, kept for the tests (and bench runs) that take other paths ──
    _text("VX_CPU_WIDEN", "auto",
          "Widened (fp32 or bf16-panel) weight copies: `auto` where the CPU has no bf16 "
          "arithmetic, `1` always, `0` never.",
          "tests/gpu/cpu/test_widen.py, tests/gpu/cpu/test_kernel_targets.py"),
    _switch("VX_CPU_PANEL_GEMM",
            "The AVX2 panel GEMM on bf16 panels; `0`: the fp32 copy in oneDNN's layout instead.",
            "tests/gpu/cpu/test_widen.py"),
    _switch("VX_CPU_COMPACT",
            "The compact weight copy for 1-4 row GEMMs on AVX2; `0`: the panel GEMM (or the "
            "skinny GEMM, for a weight without panels) on the bf16 weight.",
            "tests/gpu/cpu/test_widen.py, tests/gpu/cpu/test_kernel_targets.py"),
    _switch("VX_CPU_AMX_VNNI",
            "The AMX VNNI GEMM on AMX CPUs; `0`: oneDNN's prepacked GEMM past the skinny rows.",
            "tests/gpu/cpu/test_vnni_gemm.py"),
    _switch("VX_CPU_ROW_PLAN",
            "Big CPU GEMMs cut into row chunks where the load-time timing says it pays; `0`: one "
            "call.",
            "tests/gpu/cpu/test_row_plan.py"),
    _switch("VX_CPU_SCREEN_HEAD",
            "The LM head's int8 screen for greedy rows (exact candidates re-scored); `0`: full "
            "logits.",
            "tests (test_screen, test_model_runner, test_kernel_targets)"),
    _switch("VX_CPU_DECODE_STEP",
            "The fused C step (every layer in one call); `0`: the module path.",
            "tests/gpu/cpu/test_fused_step.py"),
    EnvVar(name="VX_CPU_SPLIT_STEP", type="integer", parse=_int_or_none,
           shown_default="unset: 2 on two threads of the VNNI GEMM, else off",
           doc="Parts of a split decode step, one per thread (0 or 1: never split).",
           set_by="tests/gpu/cpu/test_fused_step.py, tests/gpu/sample/test_greedy_step.py"),
    EnvVar(name="VX_CPU_SPLIT_MIN_ROWS", type="integer", parse=int, default=16,
           shown_default="`16`", doc="Fewest rows each part of a split decode step takes.",
           set_by="tests/gpu/cpu/test_fused_step.py, tests/gpu/sample/test_greedy_step.py"),
    EnvVar(name="VX_QUANT_MAX_ROWS", type="integer", parse=_int_or_none,
           shown_default="per kernel: 8 (int8 C kernels), 2 (AVX2 int4), 4 (torch's)",
           doc="Most rows a step sends to the int8/int4 weights (more take the dense weight).",
           set_by="tests/gpu/layers/test_quantization.py, tests/gpu/cpu/test_fused_step.py"),
    _switch("VX_CPU_ATTENTION_AMX",
            "AMX in the C kernels where the CPU has it (the decode and prefill attention, the "
            "AMX GEMMs); `0`: off, the paths of AVX512-BF16 without AMX.",
            "tests/gpu/cpu/test_emulated_isa.py, tests/gpu/cpu/test_kernel_library.py"),
    _switch("VX_CPU_WORK_STEALING",
            "The C kernels' parallel loops take a late thread's leftovers; `0`: static ranges "
            "(a served A/B).",
            "bench/compare.py (`--vx-variant 'static=VX_CPU_WORK_STEALING=0'`)"),
    _text("VX_KV_LAYOUT", "block",
          "CPU KV cache layout: `block` (block-major memory), anything else (`head`): "
          "head-major.",
          "tests/gpu/attention/test_paged_attention.py"),
    _text("VX_CPU_MARCH", "",
          "The -march the C kernel library is built with instead of `native` (e.g. `x86-64-v3`: "
          "the AVX2 kernels on an AVX-512 CPU), in its own cache folder.",
          "tests/e2e/test_spec_decode.py"),
    _text("VX_CPU_SANITIZE", "",
          "A sanitizer for the C kernel library (`address`, or any `-fsanitize=` value): a "
          "separate -O1 build with frame pointers and debug lines; the process needs the "
          "sanitizer's runtime preloaded.",
          "Makefile (`make check-c`)"),
    EnvVar(name="VX_CPU_EMULATE", type="flag (1: on)", parse=_on_if_1, default=False,
           shown_default="0",
           doc="`1` builds the kernel library for an emulated Sapphire Rapids (SIMDe) and routes "
               "the layers by it (tests only, never serving).",
           set_by="tests/gpu/cpu/test_emulated_isa.py"),
    _text("VX_TEST_POISON", "",
          "Fault injection: `engine:SEED,worker:SEED` makes requests with that seed raise there "
          "(vx/fault_injection.py; tests only).",
          "tests/reliability (G9), tests/gpu/test_model_runner.py"),
    # ── names vx did not invent ──
    _text("CC", "cc", "The C compiler that builds the CPU kernel library (else `gcc`).",
          "operator", external=True),
    EnvVar(name="HF_HUB_OFFLINE", type="boolean", parse=_hf_true, default=False,
           shown_default="off",
           doc="`1`/`ON`/`YES`/`TRUE`: resolve hub ids from the local cache only.",
           set_by="operator", external=True),
    _text("CUDA_VISIBLE_DEVICES", "",
          "Read only for the first visible device's NVML index (its GPU memory).",
          "operator", external=True),
    EnvVar(name="TRITON_INTERPRET", type="flag (1: on)", parse=_on_if_1, default=False,
           shown_default="0",
           doc="`1`: Triton's interpreter runs the kernels (on CPU); vx then accepts CPU tensors.",
           set_by="tests/gpu/test_triton.py, tests/gpu/test_cuda_graphs.py", external=True),
    # torchrun's (and Slurm / LeaderWorkerSet launch scripts') rendezvous, one vx per node
    _text("MASTER_ADDR", "",
          "Node 0's address: the default of `vx serve --master-addr` (else 127.0.0.1).",
          "operator (torchrun)", external=True),
    EnvVar(name="MASTER_PORT", type="integer", parse=_int_or_none, default=None,
           shown_default="unset",
           doc="Under torchrun: `vx serve --master-port` defaults to the port after it (torchrun's "
               "store holds this one).",
           set_by="operator (torchrun)", external=True),
    EnvVar(name="WORLD_SIZE", type="integer", parse=_int_or_none, default=None,
           shown_default="unset",
           doc="The default of `vx serve --nnodes` (one vx process per node).",
           set_by="operator (torchrun)", external=True),
    EnvVar(name="RANK", type="integer", parse=_int_or_none, default=None, shown_default="unset",
           doc="The default of `vx serve --node-rank`; a rank above 0 runs `--headless`.",
           set_by="operator (torchrun)", external=True),
    _text("TORCHELASTIC_USE_AGENT_STORE", "",
          "Set by torchrun's agent (its processes join the agent's store); vx removes it before "
          "joining its own world, whose store rank 0 hosts.",
          "torchrun", external=True),
    # ── read by tests and bench scripts, not by the vx package ──
    _text("VX_RELIABILITY_FIGURES", "/tmp/vx-reliability-figures.txt",
          "File the reliability tests append their figures to.",
          "operator of the tests", read_in="tests/reliability/conftest.py"),
    _text("VX_PEERS_SH", "<repo>/../shared/peers/peers.sh",
          "The script that starts and stops the peer servers (vLLM, llama.cpp) for a comparison.",
          "operator of the bench", read_in="bench/compare.py"),
    _text("VX_VLLM_MODEL", "$PEER_DIR/models/smollm2-135m-hf",
          "HF directory vLLM loads in the offline comparison.",
          "operator of the bench", read_in="bench/offline.py"),
    _text("PEER_DIR", "~/.cache/vx-peers",
          "Where the peers (vLLM's venv, llama.cpp, their models) are installed.",
          "operator of the bench", read_in="bench/compare.py, bench/offline.py"),
    _text("VLLM_PYTHON", "$PEER_DIR/vllmcpu/bin/python", "The Python of vLLM's venv.",
          "operator of the bench", read_in="bench/offline.py, bench/scheduler.py"),
    _text("VX_SMOLLM2_DIR", "",
          "SmolLM2 HF directory for the GPU check's parity run (else one under `$VX_CACHE`).",
          "operator of the bench", read_in="bench/gpu_check.sh"),
    _text("VX_GPU_CHECK_RESULTS", "$OUTDIR/gpu_check.jsonl",
          "Where the GPU check appends its JSON lines.",
          "operator of the bench", read_in="bench/gpu_check.sh"),
    _text("VX_GPU_CHECK_BUDGET_S", "470", "Seconds the whole GPU check may take.",
          "operator of the bench", read_in="bench/gpu_check.sh"),
)}  # fmt: skip


def export(name: str, value: str | None) -> None:
    """Set a declared variable in this process's environment, so its children inherit it, or
    remove it with None. Invariant: only names in `ENV_VARS` are written."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not declared in vx/envs.py")
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def __getattr__(name: str) -> Any:
    var = ENV_VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return [*__all__, *ENV_VARS]


_SECTIONS = (
    ("Settings for an operator", lambda v: not v.external and v.read_in == "vx"
     and v.set_by.startswith("operator")),
    ("Switches kept for tests and bench runs", lambda v: not v.external and v.read_in == "vx"
     and not v.set_by.startswith("operator")),
    ("Names vx did not invent", lambda v: v.external),
    ("Read by tests and bench scripts, not by vx", lambda v: v.read_in != "vx"),
)  # fmt: skip


def markdown() -> str:
    """docs/configuration.md: every variable, by section, as a table."""
    lines = [
        "# Configuration: environment variables",
        "",
        "<!-- Generated from vx/envs.py by `python -m vx.envs --markdown > docs/configuration.md`;"
        " edit the registry, not this file (tests/test_envs.py checks they agree). -->",
        "",
        "Every environment variable vx reads is declared once, in `vx/envs.py`; code reads it as",
        "`envs.VX_LOG_LEVEL`, at the time of the read. Switches are on unless set to `0`. The last",
        "column says who sets each one: an operator, or the tests and bench scripts that need it.",
    ]
    for title, wanted in _SECTIONS:
        lines += ["", f"## {title}", ""]
        if title.startswith("Read by"):
            lines += ["| Variable | Default | Meaning | Read in |", "|---|---|---|---|"]
            rows = [(v.name, v.shown_default, v.doc, f"`{v.read_in}`")
                    for v in ENV_VARS.values() if wanted(v)]  # fmt: skip
        else:
            lines += ["| Variable | Type | Default | Meaning | Set by |", "|---|---|---|---|---|"]
            rows = [(v.name, v.type, v.shown_default, v.doc, v.set_by)
                    for v in ENV_VARS.values() if wanted(v)]  # fmt: skip
        for name, *rest in rows:
            cells = [f"`{name}`", *(c.replace("|", "\\|") for c in rest)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m vx.envs --markdown > docs/configuration.md")
    sys.stdout.write(markdown())
