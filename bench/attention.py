"""Time the CPU paged decode attention kernels alone, old against new, in the same run.

Usage (always under the shared benchmark lock):

    flock /tmp/vx-bench.lock .venv/bin/python bench/attention.py [--threads 2] [--repeats 3]
        [--baseline REV] [--sizes 1x256,16x256,64x256,1x1024,16x1024,64x1024,8x450x9]
        [--distinct-layers 30] [--kernels "old fast,new fast"]

Shapes: SmolLM2-135M's (30 layers, 9 query heads, 3 KV heads, head_dim 64, bf16, block size
16). Each size BxKV gives every request KV tokens of context (BxKVxR: R rows a request, one
block table, its last row at KV tokens, as a request verifying R - 1 drafts); every layer has its own K/V
cache (so a step reads 30 layers' KV, as the model does) and the block tables are a random
permutation of the blocks; the caches are block-major in memory, as the Worker's. One "step" is the kernel called once per layer through ctypes
(argument tuples built beforehand, so the figure is the kernel plus the bare ctypes call).
"new fast noAMX" is the working tree's fast kernel with its AMX q.k turned off.
Kernels: the portable and AVX512-BF16 kernels of `--baseline` (that revision's `vx` tree is
extracted into a temporary directory, its own `vx.gpu.cpu.library`, or `vx.gpu.kv_cache` before
that module existed, gives the library's source, which is built there) and of the working tree. Each cell is the median over `--repeats` runs of the mean ms per step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vx.gpu.cpu import library  # noqa: E402

LAYERS, HQ, HKV, D, BS = 30, 9, 3, 64, 16
#: The last commit with the first AVX512-BF16 kernel (one horizontal reduce per key and head).
DEFAULT_BASELINE = "0304f72"
ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
    ctypes.c_int, ctypes.c_float,  # window, softcap (revisions before them ignore both)
]  # fmt: skip


def baseline_lib(rev: str, tmp: str) -> ctypes.CDLL:
    """Build `rev`'s kernel library: its `vx` tree is extracted into `tmp` and its own
    `vx.gpu.cpu.library` (imported in a child process; `vx.gpu.kv_cache` in revisions before it)
    gives the source and flags, however that revision assembled them (one literal once, several
    modules' sources since)."""
    tree = os.path.join(tmp, "rev")
    os.makedirs(tree)
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", rev, "vx"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    show = (  # a source string until the C moved into vx/gpu/csrc, the files from then on
        "import importlib, json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "try:\n"
        "    k = importlib.import_module('vx.gpu.cpu.library')\n"
        "except ModuleNotFoundError:  # revisions before it: the build was in vx.gpu.kv_cache\n"
        "    k = importlib.import_module('vx.gpu.kv_cache')\n"
        "print(json.dumps([getattr(k, '_DECODE_KERNEL_SOURCE', None), "
        "list(getattr(k, '_KERNEL_SOURCES', [])), getattr(k, 'CSRC', ''), list(k._CFLAGS)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", show, tree], capture_output=True, text=True, check=True
    ).stdout
    source, files, csrc, cflags = json.loads(out.splitlines()[-1])
    so = os.path.join(tmp, "old.so")
    if source is not None:
        files, csrc = [os.path.join(tmp, "old.c")], tmp
        with open(files[0], "w") as f:
            f.write(source)
    subprocess.run(["cc", *cflags, "-I", csrc, "-o", so, *files], check=True)
    return ctypes.CDLL(so)


def kernels(rev: str, tmp: str) -> dict[str, object]:
    found = {}
    for tag, lib in (("old", baseline_lib(rev, tmp)), ("new", library.load_cpu_kernels())):
        assert lib is not None
        if tag == "old" and hasattr(lib, "vx_fast_amx"):
            lib.vx_fast_amx(1)  # its own switch (the new library's is set per timing)
        found[f"{tag} portable"] = lib.vx_decode_attention_bf16
        if hasattr(lib, "vx_decode_attention_bf16_fast") and lib.vx_has_fast_bf16():
            found[f"{tag} fast"] = lib.vx_decode_attention_bf16_fast
        elif hasattr(lib, "vx_has_avx2_attention") and lib.vx_has_avx2_attention():
            found[f"{tag} fast"] = lib.vx_decode_attention_bf16_avx2  # AVX2 builds' fast kernel
    for fn in found.values():
        fn.restype, fn.argtypes = ctypes.c_int, ARGTYPES
    lib = library.load_cpu_kernels()
    if "new fast" in found and hasattr(lib, "vx_fast_amx") and lib.vx_fast_amx(-1):
        found["new fast noAMX"] = found["new fast"]  # timed with AMX off (see time_step)
    return found


def layer_args(
    b: int, kv: int, gen: torch.Generator, distinct: int = LAYERS, rows: int = 1
) -> tuple[list[tuple], list[torch.Tensor]]:
    """Argument tuples for LAYERS layers at batch `b` and `kv` tokens (`distinct` caches, used
    in turn), and what they point at. `rows` > 1: each request has that many rows with one
    block table and lengths kv - rows + 1 .. kv, as a request verifying rows - 1 drafts."""
    width = -(-kv // BS)
    nb = b * width
    keep: list[torch.Tensor] = []
    args = []
    q = torch.randn(b * rows, HQ, D, generator=gen).to(torch.bfloat16)
    lens = (kv - rows + 1 + torch.arange(rows, dtype=torch.int32)).repeat(b)
    keep += [q, lens]
    for _ in range(distinct):
        # block-major in memory, as `vx.gpu.kv_cache.allocate_kv_caches` lays CPU caches out
        kc = torch.randn(nb, HKV, BS, D, generator=gen).to(torch.bfloat16).transpose(0, 1)
        vc = torch.randn(nb, HKV, BS, D, generator=gen).to(torch.bfloat16).transpose(0, 1)
        bt = torch.randperm(nb, generator=gen).to(torch.int32).view(b, width)
        bt = bt.repeat_interleave(rows, dim=0).contiguous()
        out = torch.empty(b * rows, HQ, D, dtype=torch.bfloat16)
        keep += [kc, vc, bt, out]
        args.append(
            (
                q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0),
                out.stride(1), kc.data_ptr(), vc.data_ptr(), *kc.stride()[:3], bt.data_ptr(),
                bt.stride(0), lens.data_ptr(), b * rows, HQ, HKV, D, BS, D**-0.5, width * BS,
                0, 0.0,
            )
        )  # fmt: skip
    return [args[i % distinct] for i in range(LAYERS)], keep


def time_step(fn, args: list[tuple], min_s: float = 0.2, amx: bool = True) -> float:
    """Mean ms per step (one call per layer) over enough steps to take `min_s`."""
    lib = library.load_cpu_kernels()
    if hasattr(lib, "vx_fast_amx"):
        lib.vx_fast_amx(int(amx))
    for a in args:  # warm-up
        assert fn(*a) == 0
    steps, t0 = 0, time.perf_counter()
    while True:
        for a in args:
            fn(*a)
        steps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_s and steps >= 3:
            return elapsed / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default=DEFAULT_BASELINE)
    p.add_argument("--sizes", default="1x256,16x256,64x256,1x1024,16x1024,64x1024")
    p.add_argument("--kernels", default="", help="comma-separated subset of kernel names")
    p.add_argument(
        "--distinct-layers", type=int, default=LAYERS,
        help="K/V caches to cycle through (1: one layer's, cache-resident at small sizes)",
    )  # fmt: skip
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        fns = kernels(a.baseline, tmp)
        if a.kernels:
            fns = {k: v for k, v in fns.items() if k in a.kernels.split(",")}
        names = list(fns)
        print(
            f"threads={torch.get_num_threads()} baseline={a.baseline} "
            f"distinct_layers={a.distinct_layers}; ms per step (x{LAYERS})"
        )
        print(f"{'BxKV':>8} " + " ".join(f"{n:>13}" for n in names) + "   new fast / old fast")
        for size in a.sizes.split(","):
            b, kv, *r = (int(x) for x in size.split("x"))
            args, keep = layer_args(b, kv, gen, a.distinct_layers, r[0] if r else 1)
            runs: dict[str, list[float]] = {n: [] for n in names}
            for _ in range(a.repeats):  # interleaved, so drift hits every kernel alike
                for n in names:
                    runs[n].append(time_step(fns[n], args, amx=not n.endswith("noAMX")))
            med = {n: statistics.median(r) for n, r in runs.items()}
            ratio = ""
            if "new fast" in med and "old fast" in med:
                ratio = f"{med['new fast'] / med['old fast']:.2f}"
            print(f"{size:>8} " + " ".join(f"{med[n]:13.3f}" for n in names) + f"   {ratio}")
            del keep


if __name__ == "__main__":
    main()
