"""The CPU kernel library builds and loads for every x86 level vx runs on, not only this CPU's.

The library is built with -march=native, so the machine a test runs on decides which kernels
exist. These tests build it for older targets as well: an AVX2 laptop or server (no AVX-512)
must get a library the loader can bind, whose callers then take the portable paths.
"""

from __future__ import annotations

import platform
import shutil

import pytest

from vx.gpu.cpu import library

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
    reason="x86 targets with a C compiler",
)


@pytest.fixture(autouse=True)
def _own_kernel_caches(monkeypatch):
    """Each test here works on copies of the modules' kernel caches: a library built for an
    older target and bound while a test ran must not stay behind in a cache that the later
    tests (and the Worker's code under them) read, or their C paths silently go missing."""
    from vx.gpu.cpu import ops as cpu_ops, vnni as cpu_vnni, widen as cpu_widen

    for module, name in ((library, "_kernel_state"), (library, "_fast_state"),
                         (cpu_ops, "_gemv_state"), (cpu_vnni, "_state"),
                         (cpu_widen, "_state")):  # fmt: skip
        monkeypatch.setattr(module, name, dict(getattr(module, name)))


def _build(march: str, tmp_path, monkeypatch):
    """The kernel library built for `march` instead of this CPU (its own cache directory)."""
    flags = [f if f != "-march=native" else f"-march={march}" for f in library.CFLAGS]
    assert flags != library.CFLAGS
    monkeypatch.setenv("VX_CACHE", str(tmp_path))
    monkeypatch.setattr(library, "_CFLAGS", flags)
    return library._build_kernels()  # binds every symbol the callers may look up


def _avx2_build(tmp_path, monkeypatch):
    """The x86-64-v3 build, whose AVX2 kernels run on any CPU with AVX2 (AVX-512 ones too)."""
    with open("/proc/cpuinfo") as f:
        if "avx2" not in f.read():
            pytest.skip("no AVX2 here")
    return _build("x86-64-v3", tmp_path, monkeypatch)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("march", "avx512", "step"), [("x86-64-v4", 1, 1), ("x86-64-v3", 0, 2), ("x86-64-v2", 0, 0)]
)
def test_library_builds_and_binds_on_older_targets(
    tmp_path, monkeypatch, march: str, avx512: int, step: int
) -> None:
    lib = _build(march, tmp_path, monkeypatch)
    assert lib is not None
    # Without AVX-512 the AVX-512 skinny GEMM is left out, and it says it takes no rows;
    # AVX-512 without BF16 (x86-64-v4) has the FMA GEMM but no fast kernels. The fused step is
    # built on AVX-512 (1) and on AVX2 (2, on the AVX2 GEMM), not below.
    assert lib.vx_has_gemv() == avx512
    assert (lib.vx_gemv_bf16_max_rows() > 0) == bool(avx512)
    assert lib.vx_has_decode_step() == step
    assert lib.vx_has_fast_bf16() == 0
    # the prefill attention: AVX2 without AVX-512 has its own kernel (AMX is not built here)
    assert lib.vx_has_prefill_attention() == (2 if march == "x86-64-v3" else 0)
    assert list(tmp_path.glob("kernels/decode_attention-*.so"))


@pytest.mark.timeout(240)
def test_avx2_skinny_gemm_is_the_bf16_gemm(tmp_path, monkeypatch) -> None:
    """The AVX2 skinny GEMM (built for x86-64-v3 only, so run here from that build, on any
    CPU with AVX2): fp32 sums of the exact products, one rounding, bias included."""
    import torch

    lib = _avx2_build(tmp_path, monkeypatch)
    assert lib.vx_gemv_avx2_max_rows() == 24
    g = torch.Generator().manual_seed(0)
    # 1-3 rows: one tile; 4-24 rows: tiles of 3 rows over each group of weight rows
    for m, n, k in [(1, 96, 64), (2, 97, 576), (3, 5, 1536), (4, 130, 72), (7, 33, 576),
                    (24, 64, 128)]:  # fmt: skip
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        x = torch.randn(m, k + 8, generator=g).bfloat16()[:, :k]  # a row stride past k
        bias = torch.randn(n, generator=g).bfloat16()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        args = (w.data_ptr(), bias.data_ptr(), y.data_ptr(), n, n, k)
        assert lib.vx_gemv_bf16_avx2(x.data_ptr(), x.stride(0), m, *args) == 0
        want = (x.double() @ w.double().T + bias.double()).bfloat16()
        tol = want.float().abs() * 2**-7 + 1e-5 * (x.float().abs() @ w.float().abs().T)
        assert ((y.float() - want.float()).abs() <= tol).all(), (m, n, k)
        assert (y == want).float().mean() > 0.95
    x = torch.randn(25, k, generator=g).bfloat16()
    y = torch.empty(25, n, dtype=torch.bfloat16)
    args = (w.data_ptr(), bias.data_ptr(), y.data_ptr(), n, n, k)
    assert lib.vx_gemv_bf16_avx2(x.data_ptr(), k, 25, *args) == -1  # > 24 rows


@pytest.mark.timeout(240)
def test_avx2_compact_gemm_is_the_panel_gemm(tmp_path, monkeypatch) -> None:
    """The compact GEMM (`vx_gemv_compact_avx2`, x86-64-v3 build, on any AVX2 CPU) on W's
    compact copy in panel order gives `vx_gemm_panels_avx2`'s outputs bit for bit, at one to
    four rows, with and without bias, raw blocks and odd values included; more rows, N % 16 and
    odd K refused."""
    import torch

    from vx.gpu.cpu import widen as cpu_widen
    from vx.gpu.cpu.compact import CompactWeight

    lib = _avx2_build(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_widen, "_state", {"skinny": 24, "lib": lib})
    assert lib.vx_compact_max_rows() == 4
    g = torch.Generator().manual_seed(0)
    # one panel, a last item of fewer panels than one-row items take (4), K % 32 != 0
    for n, k in [(16, 32), (112, 64), (96, 578), (48, 1536)]:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        w[0, :3] = 0.0  # a raw block
        w[-1, k // 2] = 40.0  # another
        w[1, 5] = float("nan")
        c = CompactWeight.maybe(lib, w)
        assert c is not None and c.raw.shape[0] >= 2
        panels = cpu_widen.pack_panels(w)
        for m in (1, 2, 3, 4):
            x = torch.randn(m, k + 8, generator=g).bfloat16()[:, :k]  # a row stride past k
            for b in (torch.randn(n, generator=g).bfloat16(), None):
                want = torch.empty(m, n, dtype=torch.bfloat16)
                ptrs = (panels.data_ptr(), None if b is None else b.data_ptr(), want.data_ptr())
                assert lib.vx_gemm_panels_avx2(x.data_ptr(), x.stride(0), m, *ptrs, n, n, k) == 0
                got = c.apply(x, b)
                assert got is not None and got.shape == (m, n)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, m)
    x = torch.randn(5, k, generator=g).bfloat16()
    assert c.apply(x, None) is None  # five rows: the panels'
    y = torch.empty(5, n, dtype=torch.bfloat16)
    assert lib.vx_gemv_compact_avx2(x.data_ptr(), k, 5, c.blocks.data_ptr(), c.hb.data_ptr(),
                                    c.raw.data_ptr(), None, y.data_ptr(), n, n, k) == -1  # fmt: skip
    assert lib.vx_gemv_compact_avx2(x.data_ptr(), k, 1, c.blocks.data_ptr(), c.hb.data_ptr(),
                                    c.raw.data_ptr(), None, y.data_ptr(), 40, 40, k) == -1  # fmt: skip
    assert CompactWeight.maybe(lib, torch.zeros(40, 48, dtype=torch.bfloat16)) is None
    assert CompactWeight.maybe(lib, torch.zeros(16, 47, dtype=torch.bfloat16)) is None
    monkeypatch.setenv("VX_CPU_COMPACT", "0")
    assert CompactWeight.maybe(lib, w) is None


@pytest.mark.timeout(240)
def test_avx2_panel_gemm_is_the_bf16_gemm(tmp_path, monkeypatch) -> None:
    """The AVX2 panel GEMM (`vx_gemm_panels_avx2`, x86-64-v3 build, on any AVX2 CPU) on W's
    bf16 panels (`pack_panels`): fp32 sums of the exact products, the bias, one rounding; a
    row alone the same bits as in its batch (whatever its place in a 6-row tile or a block of
    rows); NaNs stay NaN; N % 16 and odd K refused."""
    import torch

    from vx.gpu.cpu import widen as cpu_widen

    lib = _avx2_build(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_widen, "_state", {"skinny": 24, "lib": lib})
    assert lib.vx_has_gemm_panels_avx2() == 1
    g = torch.Generator().manual_seed(0)
    # rows: one partial tile, tiles and a remainder, several row blocks (K = 1536: 30 rows)
    for m, n, k in [(1, 16, 8), (5, 48, 576), (25, 96, 576), (70, 32, 1536), (200, 16, 100)]:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        panels = cpu_widen.pack_panels(w)
        assert panels is not None and panels.shape == (n // 16, k // 2, 16, 2)
        p = 1 % (n // 16)  # column 3 of panel p: its k pairs, in order
        assert torch.equal(panels[p, :, 3].reshape(k), w[16 * p + 3])
        assert torch.equal(cpu_widen.pack_panels(w.float()), panels)  # fp32 of bf16 values
        x = torch.randn(m, k + 8, generator=g).bfloat16()[:, :k]  # a row stride past k
        bias = torch.randn(n, generator=g).bfloat16()
        for b in (bias, None):
            y = torch.empty(m, n, dtype=torch.bfloat16)
            ptrs = (panels.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), n, n, k)
            assert lib.vx_gemm_panels_avx2(x.data_ptr(), x.stride(0), m, *ptrs) == 0
            want = x.double() @ w.double().T + (0 if b is None else b.double())
            tol = want.abs() * 2**-8 + 1e-6 * (x.double().abs() @ w.double().abs().T)
            assert ((y.double() - want).abs() <= tol).all(), (m, n, k)
            for i in {0, m // 2, m - 1}:
                alone = torch.empty(1, n, dtype=torch.bfloat16)
                ptrs = (panels.data_ptr(), None if b is None else b.data_ptr(), alone.data_ptr())
                assert lib.vx_gemm_panels_avx2(x[i].data_ptr(), k, 1, *ptrs, n, n, k) == 0
                assert torch.equal(alone[0], y[i]), (m, i)
    x = torch.randn(3, k, generator=g).bfloat16()
    x[1, 0] = float("nan")
    y = torch.empty(3, n, dtype=torch.bfloat16)
    assert lib.vx_gemm_panels_avx2(x.data_ptr(), k, 3, panels.data_ptr(), None, y.data_ptr(),
                                   n, n, k) == 0  # fmt: skip
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
    assert cpu_widen.pack_panels(torch.randn(40, 8)) is None
    assert cpu_widen.pack_panels(torch.randn(32, 7)) is None
    assert lib.vx_gemm_panels_avx2(x.data_ptr(), 8, 1, panels.data_ptr(), None, y.data_ptr(),
                                   24, 24, 8) == -1  # fmt: skip
    assert lib.vx_gemm_panels_avx2(x.data_ptr(), 7, 1, panels.data_ptr(), None, y.data_ptr(),
                                   16, 16, 7) == -1  # fmt: skip


@pytest.mark.timeout(240)
def test_avx2_int8_gemm_is_the_dequantized_gemm(tmp_path, monkeypatch) -> None:
    """The AVX2 int8 kernel (`--quantization int8` on AVX2 CPUs, from the x86-64-v3 build) on
    its packed layout: (x . q) * scale + bias from fp32 sums of exact products, one rounding,
    as the AVX-512 kernel computes it; the tiles of 1-3 rows, a last group of fewer than 4
    weight rows, and a row stride past K."""
    import torch

    from vx.gpu.cpu import widen as cpu_widen
    from vx.gpu.layers.quantization import quantize_int8

    lib = _avx2_build(tmp_path, monkeypatch)
    monkeypatch.setattr(library, "_kernel_state", {"lib": lib})
    monkeypatch.setattr(cpu_widen, "_state", {})
    g = torch.Generator().manual_seed(1)
    for m, n, k in [(1, 96, 64), (2, 97, 576), (3, 5, 1536), (4, 130, 96), (8, 33, 576),
                    (24, 64, 128)]:  # fmt: skip
        q, s = quantize_int8((torch.randn(n, k, generator=g) * 0.05).bfloat16())
        packed = cpu_widen.pack_int8_avx2(q)
        assert packed is not None and not torch.equal(packed, q)
        x = torch.randn(m, k + 8, generator=g).bfloat16()[:, :k]
        for bias in (torch.randn(n, generator=g).bfloat16(), None):
            y = torch.empty(m, n, dtype=torch.bfloat16)
            b = None if bias is None else bias.data_ptr()
            args = (packed.data_ptr(), s.data_ptr(), b, y.data_ptr(), n, n, k)
            assert lib.vx_gemv_int8_avx2(x.data_ptr(), x.stride(0), m, *args) == 0
            exact = (x.double() @ q.double().T) * s.double()
            want = (exact + (0 if bias is None else bias.double())).bfloat16()
            tol = want.float().abs() * 2**-7 + 1e-5 * (x.float().abs() @ q.float().abs().T)
            assert ((y.float() - want.float()).abs() <= tol).all(), (m, n, k)
            assert (y == want).float().mean() > 0.95
    x = torch.randn(25, k, generator=g).bfloat16()
    y = torch.empty(25, n, dtype=torch.bfloat16)
    args = (packed.data_ptr(), s.data_ptr(), None, y.data_ptr(), n, n, k)
    assert lib.vx_gemv_int8_avx2(x.data_ptr(), k, 25, *args) == -1  # > 24 rows
    assert lib.vx_gemv_int8_avx2(x.data_ptr(), k, 1, *args[:-1], k - 8) == -1  # K % 32
    assert cpu_widen.pack_int8_avx2(q[:, :-8]) is None


@pytest.mark.timeout(240)
def test_avx2_int4_gemm_is_the_dequantized_gemm(tmp_path, monkeypatch) -> None:
    """The AVX2 int4 kernel (`--quantization int4` on AVX2 CPUs, from the x86-64-v3 build):
    x @ W.T + bias for W the dequantized groups of 32 ((q - 8) s + z), fp32 sums, one
    rounding; tiles of 1 and 2 rows, a last group of fewer than 4 weight rows, a row stride
    past K; the packed nibbles are the columns the layout says."""
    import torch

    from vx.gpu.cpu import widen as cpu_widen
    from vx.gpu.layers.quantization import dequantize_int4, quantize_int4

    lib = _avx2_build(tmp_path, monkeypatch)
    monkeypatch.setattr(library, "_kernel_state", {"lib": lib})
    monkeypatch.setattr(cpu_widen, "_state", {})
    g = torch.Generator().manual_seed(2)
    for m, n, k in [(1, 96, 64), (2, 97, 576), (3, 5, 1536), (5, 130, 128), (24, 64, 192)]:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        q, scales, zeros = quantize_int4(w)
        packed = cpu_widen.Int4Avx2(q, scales, zeros)
        # column 8 j + i of each 64-column block is nibble j of 32-bit word i (as q - 8)
        words = packed.q.view(torch.int32).view(n, k // 64, 8).to(torch.int64) & 0xFFFFFFFF
        col = (words[:, :, None, :] >> (4 * torch.arange(8)).view(1, 1, 8, 1)) & 0xF
        assert torch.equal(((col + 8) & 0xF).reshape(n, k), q.to(torch.int64))
        ref = dequantize_int4(q, scales, zeros).double()
        x = torch.randn(m, k + 8, generator=g).bfloat16()[:, :k]
        for bias in (torch.randn(n, generator=g).bfloat16(), None):
            y = packed.apply(x, bias)
            assert y is not None
            want = (x.double() @ ref.T + (0 if bias is None else bias.double())).bfloat16()
            tol = want.float().abs() * 2**-7 + 1e-5 * (x.float().abs() @ ref.float().abs().T)
            assert ((y.float() - want.float()).abs() <= tol).all(), (m, n, k)
            assert (y == want).float().mean() > 0.9
    assert packed.apply(torch.randn(25, k).bfloat16(), None) is None  # > 24 rows
    assert cpu_widen.Int4Avx2.takes(576) and not cpu_widen.Int4Avx2.takes(96)


@pytest.mark.timeout(240)
def test_avx2_decode_attention_matches_the_portable_kernel(tmp_path, monkeypatch) -> None:
    """The AVX2 decode attention from the x86-64-v3 build (run on any AVX2 CPU) against the
    portable kernel of the same build: bf16 outputs within a bf16 step, empty rows zero; and
    each row's output the same bits alone (one thread's call, or two threads' on its three
    kv heads) as in its batch."""
    import torch

    lib = _avx2_build(tmp_path, monkeypatch)
    assert lib.vx_has_avx2_attention() == 1
    g = torch.Generator().manual_seed(0)
    # query heads per kv head 3, 8, 2, 7 and 1 and head dims 64, 128, 80 and 96: the kernel's
    # tiles of up to 3 heads x 4 keys (q.k) and 3 heads x 32 dims (P V) and their remainders
    cases = [(9, 3, 64, 16, [1, 17, 300]), (8, 1, 128, 8, [40, 5]), (4, 2, 64, 48, [0, 200, 97]),
             (14, 2, 80, 16, [3, 33, 129]), (5, 5, 96, 16, [1, 250])]  # fmt: skip
    for hq, hkv, d, bs, lens in cases:
        b, width = len(lens), -(-max(lens) // bs)
        nb = b * width + 2
        kc = torch.randn(nb, hkv, bs, d, generator=g).bfloat16().transpose(0, 1)  # block-major
        vc = torch.randn(nb, hkv, bs, d, generator=g).bfloat16().transpose(0, 1)
        q = torch.randn(b, hq, d, generator=g).bfloat16()
        table = torch.randperm(nb, generator=g)[: b * width].view(b, width).int().contiguous()
        seq = torch.tensor(lens, dtype=torch.int32)
        outs = [torch.zeros_like(q), torch.zeros_like(q)]
        kernels = (lib.vx_decode_attention_bf16, lib.vx_decode_attention_bf16_avx2)
        for fn, out in zip(kernels, outs, strict=True):
            rc = fn(
                q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0),
                out.stride(1), kc.data_ptr(), vc.data_ptr(), *kc.stride()[:3],
                table.data_ptr(), table.stride(0), seq.data_ptr(), b, hq, hkv, d, bs,
                d**-0.5, width * bs, 0, 0.0,
            )  # fmt: skip
            assert rc == 0
        diff = (outs[0].float() - outs[1].float()).abs()
        assert (diff <= outs[0].float().abs() * 2.0**-7 + 1e-3).all(), (hq, d)
        for i, n in enumerate(lens):
            alone = torch.zeros_like(q[i : i + 1])
            rc = lib.vx_decode_attention_bf16_avx2(
                q[i].data_ptr(), q.stride(0), q.stride(1), alone.data_ptr(), alone.stride(0),
                alone.stride(1), kc.data_ptr(), vc.data_ptr(), *kc.stride()[:3],
                table[i].data_ptr(), table.stride(0), seq[i].data_ptr(), 1, hq, hkv, d, bs,
                d**-0.5, max(n, 1), 0, 0.0,
            )  # fmt: skip
            assert rc == 0 and torch.equal(alone[0], outs[1][i]), (hq, i)
            if n == 0:
                assert not outs[1][i].any()


@pytest.mark.timeout(240)
def test_avx2_prefill_attention_matches_fp64(tmp_path, monkeypatch) -> None:
    """The AVX2 prefill attention (`vx/gpu/cpu/csrc/prefill_avx2.c`, from the x86-64-v3 build,
    reached through `vx_prefill_attention_bf16`): every chunk of a call, causal after its
    cached prefix, read through a scattered block table, within a bf16 rounding of an fp64
    reference; shapes it cannot take are declined before anything is written."""
    import torch

    lib = _avx2_build(tmp_path, monkeypatch)
    assert lib.vx_has_prefill_attention() == 2
    g = torch.Generator().manual_seed(0)
    # (hq, hkv, d, block size, [(cached, new) per chunk]): past one 128-key softmax chunk and
    # one 16-query item, 1-6 rows left for the last register tile, D % 16 == 8, D = 256
    for hq, hkv, d, bs, chunks in [
        (9, 3, 64, 16, [(0, 1), (5, 3), (100, 37), (0, 300)]),
        (8, 2, 128, 16, [(17, 50), (0, 16)]),
        (4, 4, 72, 8, [(3, 29)]),
        (6, 1, 8, 32, [(0, 70), (200, 1)]),
        (14, 2, 64, 16, [(130, 130)]),
        (2, 1, 256, 16, [(0, 40)]),
    ]:
        widths = [-(-(c + n) // bs) for c, n in chunks]
        nb = sum(widths) + 3
        kc = torch.randn(nb, hkv, bs, d, generator=g).bfloat16().transpose(0, 1)  # block-major
        vc = torch.randn(nb, hkv, bs, d, generator=g).bfloat16().transpose(0, 1)
        t = sum(n for _, n in chunks)
        q = (torch.randn(t, hq, d + 8, generator=g) * 2).bfloat16()[:, :, :d]  # row strides
        perm, table = torch.randperm(nb, generator=g), torch.zeros(len(chunks), max(widths))
        for i, w in enumerate(widths):
            table[i, :w] = perm[sum(widths[:i]) : sum(widths[: i + 1])]
        table = table.int()
        starts = torch.tensor([sum(n for _, n in chunks[:i]) for i in range(len(chunks))])
        lens = torch.tensor([n for _, n in chunks])
        computed = torch.tensor([c for c, _ in chunks])
        starts, lens, computed = starts.int(), lens.int(), computed.int()
        out = torch.zeros(t, hq, d + 4, dtype=torch.bfloat16)[:, :, :d]

        fn, scale = lib.vx_prefill_attention_bf16, d**-0.5
        head = (
            q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            kc.data_ptr(), vc.data_ptr(), *kc.stride()[:3], table.data_ptr(), table.stride(0),
            starts.data_ptr(), lens.data_ptr(), computed.data_ptr(), len(chunks),
        )  # fmt: skip
        # D % 8, D > 256, Hq % Hkv
        assert fn(*head, hq, hkv, d - 4, bs, scale, 0, 0.0) == -2
        assert fn(*head, hq, hkv, 264, bs, scale, 0, 0.0) == -2
        assert hkv == 1 or fn(*head, hq + 1, hkv, d, bs, scale, 0, 0.0) == -2
        assert not out.any()
        assert fn(*head, hq, hkv, d, bs, scale, 0, 0.0) == 0
        for i, (c, n) in enumerate(chunks):
            ids = table[i, : widths[i]].long()
            k = kc[:, ids].reshape(hkv, -1, d)[:, : c + n].double()
            v = vc[:, ids].reshape(hkv, -1, d)[:, : c + n].double()
            k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
            s = q[starts[i] : starts[i] + n].double().transpose(0, 1) @ k.transpose(1, 2)
            later = torch.arange(c + n)[None, :] > c + torch.arange(n)[:, None]
            p = (s * d**-0.5).masked_fill(later, float("-inf")).softmax(-1)
            want = (p @ v).transpose(0, 1)
            got = out[starts[i] : starts[i] + n].double()
            assert ((got - want).abs() <= want.abs() * 2.0**-8 + 1e-5).all(), (hq, d, i)


@pytest.mark.timeout(240)
def test_avx2_window_kernels(tmp_path, monkeypatch) -> None:
    """The x86-64-v3 build's AVX2 decode and prefill attention with sliding windows and a
    soft-cap (tests/gpu/attention/test_window_kernels.py's cases), through the routing the
    windowed layers use."""
    from tests.gpu.attention.test_window_kernels import check_window_kernels

    lib = _avx2_build(tmp_path, monkeypatch)
    assert lib.vx_has_avx2_attention() and lib.vx_has_prefill_attention() == 2
    monkeypatch.setattr(library, "_kernel_state", {"lib": lib})
    monkeypatch.setattr(library, "_fast_state", {"fast": True})
    check_window_kernels()
    monkeypatch.setattr(library, "_fast_state", {"fast": False})  # the portable decode kernel
    check_window_kernels(prefill=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case",
    ["llama-d16", "qwen2-bias", "llama-int8", "llama-int4", "qwen3", "phi3-partial", "gemma2",
     "gemma3"],
)  # fmt: skip
def test_avx2_fused_step_equals_the_module_path(tmp_path, monkeypatch, case: str) -> None:
    """The fused step of the x86-64-v3 build (its AVX2 GEMM and attention, on any AVX2 CPU)
    against the module path on the same build: bit-identical logits at 1-24 rows (whichever of
    the compact, skinny and panel GEMMs the rows take), declined past them; with int8 or int4 weights, the AVX2 int8 or int4 kernel up to `max_rows` (8 or 2)
    rows and the bf16 GEMM past them, alike on both paths."""
    import torch

    from tests.gpu.cpu.test_fused_step import CASES, _compare
    from tests.models import make_tiny_model
    from vx.gpu.cpu import ops as cpu_ops, vnni as cpu_vnni, widen as cpu_widen
    from vx.gpu.cpu.fused_step import FusedDecode
    from vx.gpu.loader import load_model

    lib = _avx2_build(tmp_path, monkeypatch)
    # every caller takes this build, and the weights get the AVX2 path's fp32 copies
    monkeypatch.setattr(library, "_kernel_state", {"lib": lib})
    monkeypatch.setattr(cpu_ops, "_gemv_state", {})
    monkeypatch.setattr(cpu_widen, "_state", {})
    monkeypatch.setattr(cpu_vnni, "_state", {})  # none here: this build has no VNNI GEMM
    monkeypatch.setenv("VX_CPU_WIDEN", "1")
    arch, overrides, quant = CASES[case]
    path = make_tiny_model(tmp_path / "m", arch, vocab_size=512, **overrides)
    model = load_model(path, dtype=torch.bfloat16, progress=False, quantization=quant)
    fused = FusedDecode.build(model.model)
    assert fused is not None and fused.max_rows() == 24
    assert fused._quant_rows == {None: 0, "int8": 8, "int4": 2}[quant]
    # 1-4 rows: the compact copies (the panels' bits); 5-24 the bf16 panels
    for batch in (1, 4, 5, 9, 17, 24, 25):
        assert _compare(model, fused, batch) == (3 if batch <= 24 else 0), batch


@pytest.mark.timeout(240)
def test_avx2_fp32_panel_gemm_is_row_invariant(tmp_path, monkeypatch) -> None:
    """The fp32 panel GEMM of the x86-64-v3 build (`--batch-invariant` on fp32 models)."""
    from tests.gpu.cpu.test_fp32_panels import check_fp32_panels

    lib = _avx2_build(tmp_path, monkeypatch)
    assert lib.vx_has_gemm_f32_panels()
    monkeypatch.setattr(library, "_kernel_state", {"lib": lib})
    check_fp32_panels()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["llama-d64", "qwen2-bias"])
def test_avx2_batch_invariant_step(tmp_path, monkeypatch, case: str) -> None:
    """`--batch-invariant` on the x86-64-v3 build: every linear and the LM head keep the panel
    GEMM alone, for every row count, and a request's logits do not depend on the rows beside
    it or on its prompt's chunking, through the fused step and the module path
    (`test_fused_step.check_batch_invariant_step`)."""
    import torch

    from tests.gpu.cpu.test_fused_step import CASES, check_batch_invariant_step
    from tests.models import make_tiny_model
    from vx.gpu.cpu import ops as cpu_ops, vnni as cpu_vnni, widen as cpu_widen
    from vx.gpu.cpu.fused_step import FusedDecode
    from vx.gpu.layers import linear_method
    from vx.gpu.loader import load_model

    lib = _avx2_build(tmp_path, monkeypatch)
    monkeypatch.setattr(library, "_kernel_state", {"lib": lib})
    monkeypatch.setattr(cpu_ops, "_gemv_state", {})
    monkeypatch.setattr(cpu_widen, "_state", {})
    monkeypatch.setattr(cpu_vnni, "_state", {})  # none here: this build has no VNNI GEMM
    monkeypatch.setenv("VX_CPU_WIDEN", "1")
    monkeypatch.setattr(linear_method, "_batch_invariant", True)
    arch, overrides, _ = CASES[case]
    path = make_tiny_model(tmp_path / "m", arch, vocab_size=512, **overrides)
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    for lin in (model.model.layers[0].self_attn.qkv_proj, model.lm_head):
        assert lin.wide is not None and lin.wide.all_rows and lin.vnni is None
    assert model.lm_head.screen is None
    fused = FusedDecode.build(model.model, batch_invariant=True)
    assert fused is not None and fused.max_rows() == 24
    check_batch_invariant_step(model, fused)


@pytest.mark.timeout(240)
def test_avx2_screen_gives_the_logits_paths_greedy_tokens(tmp_path, monkeypatch) -> None:
    """The int8 screen of the LM head (vx.gpu.cpu.screen, from the x86-64-v3 build): its
    argmax is the argmax of the AVX2 skinny GEMM's bf16 logits (the panel GEMM's for a head
    with panels), ties to the first index
    included; the exact rows it recomputes are bit-identical to the full product's; it
    declines what it cannot decide cheaply (`tests/gpu/cpu/test_screen.check_screen`)."""
    import torch

    from tests.gpu.cpu.test_screen import check_screen
    from vx.gpu.cpu import screen as cpu_screen, widen as cpu_widen

    lib = _avx2_build(tmp_path, monkeypatch)
    monkeypatch.setattr(library, "_kernel_state", {"lib": lib})
    monkeypatch.setattr(cpu_widen, "_state", {})
    monkeypatch.setattr(cpu_screen, "MAX_ROWS", 4)
    check_screen(lib, "vx_screen_i8_avx2", "vx_gemv_bf16_avx2", 4)
    # a head with panels: its logits take them at every row count, so its candidates do too
    check_screen(lib, "vx_screen_i8_avx2", "vx_gemm_panels_avx2", 4, panels=True)
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("VX_CPU_SCREEN_HEAD", "0")
    assert not cpu_screen.screen_wanted(w)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("screened", [True, False])
def test_avx2_one_row_greedy_step_runs_whole(tmp_path, monkeypatch, screened: bool) -> None:
    """The x86-64-v3 build takes a one-row greedy decode step whole (`vx_llama_greedy_whole`:
    the embedding, every layer (its GEMMs on the compact copies), the final norm and the LM
    head's int8 screen, its exact rows on `vx_gemm_panels_avx2`, as the head's logits): the
    forward path's tokens,
    every decode step in the one call.
    With every vocab row a candidate the screen gives no token: the layers still ran once and
    the logits path gives the same tokens."""
    from tests.gpu.sample.test_greedy_step import _whole_steps_both_ways
    from vx.gpu.cpu import ops as cpu_ops, widen as cpu_widen
    from vx.gpu.cpu.step_desc import linear_desc

    lib = _avx2_build(tmp_path, monkeypatch)
    monkeypatch.setattr(library, "_kernel_state", {"lib": lib})
    monkeypatch.setattr(cpu_ops, "_gemv_state", {})
    monkeypatch.setattr(cpu_widen, "_state", {})
    monkeypatch.setenv("VX_CPU_WIDEN", "1")

    def prepare(runner):
        screen = runner._model.lm_head.argmax_screen(1)
        assert screen is not None and screen.exact_kernel() == "vx_gemm_panels_avx2"
        # the layers' one-row GEMMs run on their compact copies, in the call as in the forward
        lins = [m for m in runner._model.model.modules() if getattr(m, "wide", None) is not None]
        assert lins and all(m.wide.compact is not None for m in lins)
        assert all(linear_desc(m, True).cw for m in lins)
        if not screened:  # in place (C holds its pointer): every row is a candidate
            screen.bound[:] = 1e30

    calls = _whole_steps_both_ways(tmp_path, monkeypatch, 1, 10, prepare, here=lambda: True)
    assert calls and all(c == (1 if screened else 0) for c in calls)


@pytest.mark.timeout(240)
def test_avx2_rows_do_not_depend_on_the_rows_beside_them(tmp_path, monkeypatch) -> None:
    """Row invariance on the AVX2 build (x86-64-v3, on any AVX2 CPU): a bf16 layer's
    `WideWeight.apply` gives each row of a 1-17-row call (1-4 rows: the compact copy in panel
    order, or without one (the LM head's) the panels' small-row loop; past them the panels)
    the same bits as that row of a 40-row call (the panels, as prompts take them), with and
    without bias, so speculation's verify rows score as one-row steps do."""
    import torch

    from vx.gpu.cpu import widen as cpu_widen

    lib = _avx2_build(tmp_path, monkeypatch)
    monkeypatch.setattr(cpu_widen, "_state", {"skinny": 24, "lib": lib})
    g = torch.Generator().manual_seed(0)
    for n, k in [(512, 1536), (96, 576)]:
        w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        w[0, :3] = 0.0  # a block the compact copy stores raw
        ww = cpu_widen.WideWeight(w)
        head = cpu_widen.WideWeight(w, compact=False)
        assert ww.panels is not None and ww.compact is not None and head.compact is None
        x = torch.randn(40, k + 32, generator=g).bfloat16()[:, 16 : 16 + k]  # a row stride
        x[3, :5] = 0.0
        for lin, b in [(ww, torch.randn(n, generator=g).bfloat16()), (ww, None), (head, None)]:
            ref = lin.apply(x, b)
            for rows in range(1, 18):
                for at in {0, 40 - rows}:
                    got = lin.apply(x[at : at + rows], b)
                    assert torch.equal(
                        got.view(torch.int16), ref[at : at + rows].view(torch.int16)
                    ), (n, k, rows, at)
