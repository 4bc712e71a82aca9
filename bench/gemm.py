"""Time the CPU skinny GEMMs alone: the working tree's C kernel, a baseline revision's, and
torch's F.linear (oneDNN), interleaved in one run.

Usage (always under the shared benchmark lock):

    flock /tmp/vx-bench.lock .venv/bin/python bench/gemm.py [--rows 3,16,64,128,192]
        [--baseline REV] [--rounds 11] [--threads 2]

Shapes: SmolLM2-135M's four projections (qkv 960 x 576, o 576 x 576, gate-up 3072 x 576, down
576 x 1536), each with its own weights per layer for 30 layers (120 matrices, 212 MB: they
stream from memory, as in a model step). One "step" multiplies x of `rows` rows by all 120.
Kernels: "new C" is `vx.gpu.cpu.ops.skinny_gemm`'s bf16 path in the working tree (AMX tiles
from 3 rows where the CPU has them), "old C" the same from `--baseline` (its library built from
that revision's source; a revision whose AMX kernel takes at most 64 rows a call is called as
its caller did, 64 rows at a time), "oneDNN" torch's F.linear on the plain bf16 weights; on
AMX CPUs "AMX VNNI", the linears' GEMM from 8 rows (`vx.gpu.cpu.vnni`, on VNNI-packed
copies). The C results must be bit-identical (checked); each cell is the median ms per step over
`--rounds` rounds, every kernel timed once per round, in turn. On AVX512-BF16 CPUs without AMX
two more columns: "VNNI", the GEMM the linears take there past 12 rows (`vx.gpu.cpu.vnni`, on
its packed copies), and "oneDNN packed", oneDNN on prepacked copies (what they took before).
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vx.gpu.cpu import library, vnni as cpu_vnni  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
DEFAULT_BASELINE = "b68744b"  # 64 rows per AMX call, x re-laid out element by element


def c_kernel(lib: ctypes.CDLL, chunk: int):
    """bf16 x [M, K] @ W[N, K].T through `lib`'s C kernels, as `skinny_gemm` routes them."""
    amx = lib.vx_fast_amx(1)
    fn_amx, fn_dp = lib.vx_gemm_amx_bf16, lib.vx_gemv_bf16
    fn_amx.restype = fn_dp.restype = ctypes.c_int

    def run(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        m, (n, k) = x.shape[0], w.shape
        if amx and m > 2:
            for a in range(0, m, chunk):
                rows = min(chunk, m - a)
                rc = fn_amx(
                    ctypes.c_void_p(x[a].data_ptr()), ctypes.c_int64(x.stride(0)), rows,
                    ctypes.c_void_p(w.data_ptr()), None, ctypes.c_void_p(y[a].data_ptr()),
                    ctypes.c_int64(n), ctypes.c_int64(n), ctypes.c_int64(k),
                )  # fmt: skip
                assert rc == 0, rc
        else:
            rc = fn_dp(
                ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.stride(0)), m,
                ctypes.c_void_p(w.data_ptr()), None, None, ctypes.c_void_p(y.data_ptr()),
                ctypes.c_int64(n), ctypes.c_int64(n), ctypes.c_int64(k),
            )  # fmt: skip
            assert rc == 0, rc

    return run


def vnni_kernel(lib: ctypes.CDLL, weights: list[list[torch.Tensor]], amx: bool = False):
    """x @ W.T through the VNNI GEMM on each weight's packed copy (`vx.gpu.cpu.vnni`): the
    VDPBF16PS one, or with `amx` the AMX one (AMX CPUs)."""
    packs = {id(w): cpu_vnni.VnniWeight(w, amx=amx).packed for layer in weights for w in layer}
    fn = lib.vx_gemm_amx_vnni if amx else lib.vx_gemm_vnni_bf16

    def run(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        (n, k), m = w.shape, x.shape[0]
        rc = fn(x.data_ptr(), x.stride(0), m, packs[id(w)].data_ptr(), None, y.data_ptr(), n, n, k)
        assert rc == 0, rc

    return run


def onednn_packed(weights: list[list[torch.Tensor]]):
    """x @ W.T through oneDNN on each weight's prepacked copy (what the linears used before
    the VNNI GEMM on this kind of CPU); the output is oneDNN's own tensor."""
    from vx.gpu.layers.quantization import prepack

    packs = {id(w): prepack(w) for layer in weights for w in layer}

    def run(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        torch.ops.mkldnn._linear_pointwise(x, packs[id(w)], None, "none", [], "")

    return run


def _literals(rev: str, path: str) -> dict[str, object]:
    """The module-level string and list literals of `path` at git revision `rev`."""
    text = subprocess.run(
        ["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return found


def baseline_lib(rev: str, tmp: str) -> tuple[ctypes.CDLL, int]:
    """`rev`'s C kernel library, built as that revision built it, and the rows per AMX call its
    kernel takes: from ``vx/gpu/cpu/csrc`` (with this tree's flags) or, for revisions from
    before the C moved there, from string literals of ``vx/gpu/cpu_*_source.py``."""
    has_csrc = (
        subprocess.run(
            ["git", "-C", ROOT, "cat-file", "-e", f"{rev}:vx/gpu/cpu/csrc/vx_kernels.c"],
            capture_output=True,
        ).returncode
        == 0
    )
    if has_csrc:
        archive = subprocess.run(
            ["git", "-C", ROOT, "archive", rev, "vx/gpu/cpu/csrc"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        csrc, so = os.path.join(tmp, "vx/gpu/cpu/csrc"), os.path.join(tmp, "old.so")
        subprocess.run(
            ["cc", *library._CFLAGS, "-I", csrc, "-o", so, os.path.join(csrc, "vx_kernels.c")],
            check=True,
        )
        with open(os.path.join(csrc, "gemv.c")) as f:
            gemv_c = f.read()
        return ctypes.CDLL(so), 192 if "#define VX_AMX_MAX_ROWS 192" in gemv_c else 64
    kern = _literals(rev, "vx/gpu/cpu_kernel_source.py")
    gemv = _literals(rev, "vx/gpu/cpu_gemv_source.py")["GEMV_KERNEL_SOURCE"]
    # The library's sources in `vx.gpu.kv_cache`'s order; a revision before a file existed
    # simply has no such part.
    parts = []
    for path, name in [
        ("cpu_parallel_source.py", "PARALLEL_SOURCE"),
        ("cpu_kernel_source.py", "DECODE_KERNEL_SOURCE"),
        ("cpu_eltwise_source.py", "ELTWISE_SOURCE"),
        ("cpu_gemv_source.py", "GEMV_KERNEL_SOURCE"),
        ("cpu_gemm_vnni_source.py", "GEMM_VNNI_SOURCE"),
        ("cpu_gemv_avx2_source.py", "GEMV_AVX2_SOURCE"),
        ("cpu_screen_source.py", "SCREEN_SOURCE"),
        ("cpu_attention_avx2_source.py", "ATTENTION_AVX2_SOURCE"),
        ("cpu_prefill_avx2_source.py", "PREFILL_AVX2_SOURCE"),
        ("cpu_prefill_source.py", "PREFILL_ATTENTION_SOURCE"),
        ("cpu_prefill_avx512_source.py", "PREFILL_AVX512_SOURCE"),
        ("cpu_prefill_source.py", "PREFILL_DISPATCH_SOURCE"),
        ("cpu_decode_source.py", "DECODE_STEP_SOURCE"),
        ("cpu_split_source.py", "SPLIT_STEP_SOURCE"),
    ]:
        try:
            parts.append(_literals(rev, f"vx/gpu/{path}").get(name, ""))
        except subprocess.CalledProcessError:
            continue
    src, so = os.path.join(tmp, "old.c"), os.path.join(tmp, "old.so")
    with open(src, "w") as f:
        f.write("".join(parts))  # type: ignore[arg-type]
    subprocess.run(["cc", *kern["CFLAGS"], "-o", so, src], check=True)  # type: ignore[misc]
    return ctypes.CDLL(so), 192 if "#define VX_AMX_MAX_ROWS 192" in gemv else 64  # type: ignore[operator]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="3,16,64,128,192")
    p.add_argument("--baseline", default=DEFAULT_BASELINE)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [
        [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for n, k in SHAPES]
        for _ in range(LAYERS)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        new_lib = library.load_cpu_kernels()
        assert new_lib is not None and new_lib.vx_has_gemv(), "no C GEMM on this machine"
        kernels = {
            "old C": c_kernel(*baseline_lib(a.baseline, tmp)),
            "new C": c_kernel(new_lib, 192),
            "oneDNN": lambda x, w, y: torch.nn.functional.linear(x, w, out=y),
        }
        if cpu_vnni.vnni_wanted(weights[0][0]):  # AVX512-BF16 without AMX: what the linears use
            kernels["VNNI"] = vnni_kernel(new_lib, weights)
            kernels["oneDNN packed"] = onednn_packed(weights)
        amx_vnni = cpu_vnni.amx_vnni_wanted(weights[0][0])
        if amx_vnni:  # AMX: the linears' 8-1,024 rows (bit-identical to "new C" up to 192)
            kernels["AMX VNNI"] = vnni_kernel(new_lib, weights, amx=True)
        print(
            f"threads={torch.get_num_threads()} baseline={a.baseline}; ms per step "
            f"({LAYERS} x {len(SHAPES)} matrices, cold weights), median of {a.rounds}"
        )
        vnni = "VNNI" in kernels
        print(
            f"{'rows':>5} " + " ".join(f"{n:>9}" for n in kernels) + "   new/old  new/oneDNN"
            + ("  VNNI/packed" if vnni else "") + ("  AMXVNNI/new" if amx_vnni else "")
        )  # fmt: skip
        # without AMX the C skinny GEMM takes only a few rows: past them its columns are empty
        skinny = 1 << 30 if new_lib.vx_fast_amx(-1) else new_lib.vx_gemv_bf16_max_rows()
        nan = float("nan")
        for m in (int(r) for r in a.rows.split(",")):
            xs = [torch.randn(m, k, generator=gen).to(torch.bfloat16) for _, k in SHAPES]
            run = {n: fn for n, fn in kernels.items() if m <= skinny or n not in ("old C", "new C")}
            outs = {
                name: [torch.empty(m, n, dtype=torch.bfloat16) for n, _ in SHAPES] for name in run
            }
            for name, fn in run.items():  # warm-up and the bit-identity check
                for i, w in enumerate(weights[0]):
                    fn(xs[i], w, outs[name][i])
            same = "new C" not in run or all(
                torch.equal(o, n) for o, n in zip(outs["old C"], outs["new C"], strict=True)
            )
            if amx_vnni and "new C" in run and m <= 192:
                same = same and all(
                    torch.equal(o, n) for o, n in zip(outs["AMX VNNI"], outs["new C"], strict=True)
                )
            times: dict[str, list[float]] = {name: [] for name in run}
            for _ in range(a.rounds):
                for name, fn in run.items():
                    t0 = time.perf_counter()
                    for layer in weights:
                        for i, w in enumerate(layer):
                            fn(xs[i], w, outs[name][i])
                    times[name].append((time.perf_counter() - t0) * 1e3)
            med = {name: statistics.median(times[name]) if name in run else nan for name in kernels}
            print(
                f"{m:>5} " + " ".join(f"{med[n]:9.2f}" for n in kernels)
                + f"   {med['new C'] / med['old C']:7.2f}  {med['new C'] / med['oneDNN']:10.2f}"
                + (f"  {med['VNNI'] / med['oneDNN packed']:11.2f}" if vnni else "")
                + (f"  {med['AMX VNNI'] / med['new C']:11.2f}" if amx_vnni else "")
                + ("" if same else "   (the C kernels' outputs differ!)")
            )  # fmt: skip


if __name__ == "__main__":
    main()
