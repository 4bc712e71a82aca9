"""The fused CPU step: all decoder layers of a dense model in one C call, for steps of up to
the skinny GEMM's rows (192 with AMX; any number on the VNNI GEMM without it): decode rows, and
prefill chunks where the C prefill attention takes them (bf16 on AVX512-BF16, head size a
multiple of 32). On AVX2 CPUs without AVX-512
it takes decode steps of up to 24 rows, on the AVX2 skinny GEMM that `WideWeight` uses for them
(its bf16 weight) and the AVX2 decode attention: a one-row SmolLM2 step skips the modules'
per-layer Python and torch ops (measured shorter here on a 2-core AMD EPYC).

The blocks it runs, decided once at load (`block_extras`, per layer): Llama's (Llama, Mistral,
Qwen2), with Qwen3's per-head q/k RMSNorms or Phi-3's attention (its partial rotary turning
the first `rotary_dim` dims of each head), and Gemma's (`(1 + w)` norms before and after the
attention and the MLP, GeGLU, Gemma 3's q/k norms, and its sliding layers' own rope: the
step's second cos/sin). Each layer's sliding window and logit soft-cap (`WindowedAttention`)
go to the same C attention kernels the module path calls. A Mixtral or Qwen3-MoE layer's
`SparseMoeBlock` is taken where its experts take the AMX experts' GEMM (`CpuExperts.grouped`)
or, on AVX512-BF16 without AMX, the VNNI experts' GEMM (`grouped_vnni`; `moe_desc`): its
router, top-k, grouping, experts and weighted sum are the module path's C calls
(`vx_moe_block`), and such a model's steps stay within the skinny GEMM's rows (past them the
router goes to oneDNN on the module path). Other MoE blocks (AVX2, OLMoE's layer, quantized
experts) are declined.

Runs in: each Worker process. The C side is `vx/gpu/cpu/csrc/decode_step.c` (built into the kernel
library of `vx.gpu.cpu.library`). The model file knows nothing of it: the ModelRunner builds it
once, after the weights are loaded and processed (`FusedDecode.build`, None where it does not
apply), and then calls `FusedDecode.forward` in place of the model's forward each step; that asks
`run` first and takes the module path (`LlamaModel.run_layers`) when it answers None. Why at
load: the C descriptions point at the final weight copies, and the choice of path is the
Worker's, not the model family's.

Invariants: the C code calls the very kernels the module path calls, with the same routing, so a
fused step is bit-identical to the module path (tests/gpu/cpu/test_fused_step.py checks it); asked
for some rows only (`keep`), its last layer runs past the attention on those rows alone, as the
module path's does. `run` answers None, before touching anything, for every step it does not cover: more rows than the
skinny GEMM takes (those go to oneDNN), int8 rows past the C int8 kernel, decode rows without
the C decode kernel, or prefill chunks without the C prefill kernel (they go to SDPA). `build` answers None for a model it
cannot take as a whole (not CPU bf16, tensor parallel, int4 but on AVX2, a custom attention function, shapes
the kernels refuse; on AVX2: layers without the AVX2 skinny GEMM). `VX_CPU_DECODE_STEP=0` turns it off.

Decode-only steps of at least 32 rows on two threads and the VNNI GEMM run as two independent
sub-steps, one per thread (`vx_llama_decode_split`, `split_policy`): the threads meet once a
step instead of at each of ~300 parallel regions, and one core's memory-bound attention
may overlap the other's GEMMs (served SmolLM2, 64 clients: a little more output tok/s, within the
noise in most A/Bs; docs/performance.md). Each row goes through the same kernels with the same
routing, so the logits are the same bits. Where every row of such a step is one argmax
(`vx.gpu.sample.greedy.fused_greedy_step`), `greedy_step` puts the embedding lookup, the final norm and
the LM head's argmax in the parts too: one parallel region a step instead of four (served, 64
clients: more output tok/s; docs/performance.md). Greedy decode steps too small to split
run the same way whole on the pool (`vx/gpu/cpu/csrc/greedy_step.c`), the head's argmax for one row
by its int8 screen (`vx.gpu.cpu.screen`); on AVX2 builds one-row steps only, by the screen.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import torch

from vx import envs
from vx.gpu.cpu.library import fast_decode_attention, load_cpu_kernels
from vx.gpu.cpu.ops import AMX_MAX_ROWS, GEMV_MAX_ROWS_INT8, bf16_max_rows, gemv_kernels
from vx.gpu.cpu.row_plan import vnni_wins
from vx.gpu.cpu.step_desc import (
    GreedyTailDesc,
    KVGroupDesc,
    LayerDesc,
    LinearDesc,
    MoeDesc,
    StepDesc,
    block_extras,
    linear_desc,
    model_family,
    moe_desc,
    moe_scratch_bytes,
    norm_modules,
    ptr,
    screen_head,
    split_policy,
)
from vx.gpu.cpu.vnni import VNNI_MIN_ROWS
from vx.gpu.cpu.widen import PANEL_FROM_ROWS

logger = logging.getLogger(__name__)

__all__ = ["FusedDecode"]

#: Rows a step may have on the VNNI GEMM: the C step's row counts are ints.
_VNNI_STEP_ROWS = 1 << 30


class FusedDecode:
    """One model's C layer descriptions, and the step functions that use them.

    Entry points: `build` (once, after loading; None where the step does not apply), `forward`
    (the model's forward, with every layer in one C call where `run` takes the step),
    `greedy_decode_takes` / `greedy_decode` (a greedy decode step, its LM head's argmax
    included, in one C call; `vx.gpu.sample.greedy.fused_greedy_step`).

    Invariants: built for a `LlamaModel` (the decoder stack: `embed`, `layers`, `run_layers`,
    `final_norm`) whose weights are final: the descriptions hold their pointers, so the
    weights must not move after `build`; every entry point gives the module path's bits.
    """

    def __init__(
        self, model: Any, lib: Any, layers: list[LayerDesc], quant_rows: int, avx2_rows: int
    ) -> None:
        self._model, self._lib = model, lib
        self.batch_invariant = False  # `build`'s
        self._gemma = False  # `build`'s: Gemma's block (vx_step.gemma)
        self._rot = model.layers[0].self_attn.rotary_dim  # `build`'s: dims the rotary turns
        self._scale = model.layers[0].self_attn.scale  # the attention's scale
        self._layers = (LayerDesc * len(layers))(*layers)
        self._quant_rows = quant_rows
        self._avx2_rows = avx2_rows  # 0: the AVX-512 kernels (`bf16_max_rows` rows)
        # every linear has a VNNI copy (AVX512-BF16 without AMX): any rows (the VNNI GEMM has
        # no row cap): mixed steps of 500-1,000 rows skip the module path's per-layer Python
        # and torch ops too (measured shorter in alternated steps on a 2-core Zen 5)
        self._amx = hasattr(lib, "vx_fast_amx") and bool(lib.vx_fast_amx(-1))  # not on AVX2
        # (a MoE layer's router has no VNNI copy where it is padded: such a model's steps stay
        # at `bf16_max_rows`)
        #: every dense linear (a MoE layer's qkv and o) has a VNNI copy: without AMX they then
        #: route every row count to it (`VNNI_MIN_ROWS`), as the module path's linears do
        self._linears_vnni = all(
            lin.vn or lin.vs
            for layer in layers
            for lin in (
                (layer.qkv, layer.o) if layer.moe else (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
        )  # fmt: skip
        every = self._linears_vnni and not any(layer.moe for layer in layers)
        # With AMX the copies are the AMX GEMM's (`vx.gpu.cpu.vnni`; a gate-up's packed for the
        # SiLU epilogue): the step takes their rows, to `amx_vnni_rows()[1]`, and past the
        # skinny GEMM's only where the module path routes them to the same copies (for each
        # shape, `vnni_wins`): prompt steps then skip its Python and torch ops too (measured
        # shorter for long and short prompts, with and without decodes beside them; 2-core
        # Sapphire Rapids, SmolLM2)
        self._vnni_rows = 0
        if every:
            self._vnni_rows = lib.vx_amx_vnni_rows(1) if self._amx else _VNNI_STEP_ROWS
        self._shapes = {
            (lin.n, lin.k) for layer in layers for lin in (layer.qkv, layer.o, layer.down) if lin.n
        }
        self._kv_key: tuple[int, ...] = ()
        self.last_parts = 0  # the parts of the last step run as independent sub-steps (tests)
        self.split_parts, self.split_min_rows = split_policy(
            bool(self._vnni_rows) and not self._amx
        )
        if lib.vx_has_decode_step() == 1:
            # The split's defaults, set again for each model (tests change them): the parts'
            # cuts follow the threads' speeds, measured afresh, and a thread done with its rows
            # takes some of the other's.
            lib.vx_set_split_adapt(1)
            lib.vx_set_split_steal(1)
        attn = model.layers[0].self_attn
        self._shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self._hidden = model.norm.weight.shape[0]
        self._inter = max(layer.down.k for layer in layers)  # the dense MLPs' intermediate size
        self._moes: list[MoeDesc] = []  # `build`'s: the MoE layers' descriptions
        self._keep: list = []
        self._eps = model.layers[0].input_layernorm.eps
        # the attention `decode_kernel_fn(fast=True)` picks was built (AVX512-BF16, or AVX2)
        self._has_fast = bool(lib.vx_has_avx2_attention() if avx2_rows else lib.vx_has_fast_bf16())

    @classmethod
    def build(cls, model: Any, *, batch_invariant: bool = False) -> FusedDecode | None:
        """For a `LlamaModel` after its weights were processed; None where it does not apply
        (not on CPU, not bf16, no C kernels, `VX_CPU_DECODE_STEP=0`, ...). `batch_invariant`:
        the linears' VNNI copies take every row count (`vx.gpu.layers.linear_method`)."""
        from vx.gpu.attention.paged import paged_attention

        if not envs.VX_CPU_DECODE_STEP:
            return None
        if model.norm.weight.device.type != "cpu":  # before the C library is built or loaded
            return None
        lib = load_cpu_kernels()
        kind = 0 if lib is None else lib.vx_has_decode_step()
        avx2 = kind == 2  # built for AVX2 without AVX-512 (vx/gpu/cpu/csrc/decode_step.c)
        if kind == 0 or (not avx2 and gemv_kernels() is None):
            return None
        if model.norm.weight.dtype != torch.bfloat16:
            return None
        family = model_family(model)
        if family is None:
            return None
        descs, quant_rows, avx2_rows = [], None, 1 << 30
        moes: list[MoeDesc] = []  # the MoE layers' descriptions (their layers point at them)
        keep: list = []  # what those point at that nothing else holds
        attn0 = model.layers[0].self_attn
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            extra = block_extras(layer, family, paged_attention)
            if extra is None:
                logger.info("fused CPU step declined: %s", (type(layer), type(attn), type(mlp)))
                return None
            same = (attn.scale, attn.rotary_dim) == (attn0.scale, attn0.rotary_dim)
            if attn.head_dim % 2 or not same:  # the step's scale and rotary are one for all
                return None
            moe = None
            if hasattr(mlp, "experts"):  # a MoE MLP: AVX-512 (`vx_moe_experts_amx`, `_vnni`)
                moe = None if avx2 else moe_desc(mlp, keep)
                if moe is None:
                    logger.info("fused CPU step declined: experts without a grouped experts' GEMM")
                    return None
                moes.append(moe)
                linears = (attn.qkv_proj, attn.o_proj)
            else:
                linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            lins = [linear_desc(m, avx2) for m in linears]
            if any(d is None for d in lins):
                return None
            lins += [LinearDesc(), LinearDesc()][: 4 - len(lins)]  # a MoE layer's: unused
            if avx2:  # the rows every layer's skinny GEMM takes
                avx2_rows = min(avx2_rows, *(m.wide.skinny_rows for m in linears))
            for m in linears:
                rows = 0 if m.quant is None else m.quant.max_rows
                if quant_rows is not None and rows != quant_rows:
                    return None
                quant_rows = rows
            norms, extra_norms, numbers = extra
            if any(n.dtype != torch.bfloat16 or not n.is_contiguous() for n in norms):
                return None
            if any(n.eps != layer.input_layernorm.eps for n in norm_modules(layer)):
                return None
            descs.append(LayerDesc(
                *(n.data_ptr() for n in norms[:2]), *lins, None, None,
                *(None if n is None else n.data_ptr() for n in extra_norms), *numbers, 0,
                None if moe is None else ctypes.addressof(moe),
            ))  # fmt: skip
        if not descs:
            return None
        step = cls(model, lib, descs, quant_rows or 0, avx2_rows if avx2 else 0)
        step._moes, step._keep = moes, keep
        step.batch_invariant = batch_invariant
        step._gemma = family == "gemma"
        step._rot = attn0.rotary_dim
        step._scale = attn0.scale
        return step

    def max_rows(self) -> int:
        """The most rows a step may have here (the skinny GEMM's, or any number on the VNNI
        GEMM; AMX can be switched off)."""
        return self._avx2_rows or max(bf16_max_rows(), self._vnni_rows)

    def _int8_rows(self) -> int:
        """The most rows the C int8 kernel takes (8 on AVX-512; on AVX2 the int8 and int4
        kernels take the skinny GEMM's): quantized rows past it go to torch's kernels on the
        module path."""
        return self._avx2_rows or GEMV_MAX_ROWS_INT8

    def run(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: Any,
        tail: GreedyTailDesc | None = None,
        keep: torch.Tensor | None = None,
        screen: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All layers for a step of T rows: (last MLP output, residual), or None. With `keep`
        (`kept_rows`), the last layer's o_proj and MLP run on those rows alone, as the module
        path's, and the two come back for them only. With `tail` (`greedy_step`): as the
        split's parts, or whole where the split does not take the step (with `screen` for the
        head's argmax), and (final normed hidden states, the residual); x, cos and sin are
        then scratch the C call fills."""
        self.last_parts = 0
        t, nd = x.shape[0], md.num_decodes
        if t == 0 or (nd and not md.decode_kernel):
            return None
        hq, hkv, d = self._shape
        # prefill chunks: only where the module path takes the same C kernel for them
        if md.prefills and (md.prefill_starts is None or d % 32 or d > 256 or hq % hkv):
            return None
        if t > self.max_rows() or self._int8_rows() < t <= self._quant_rows:
            return None
        if self._amx and t > AMX_MAX_ROWS and not all(vnni_wins(n, k, t) for n, k in self._shapes):
            return None  # the module path takes oneDNN's GEMM for a shape at these rows
        if not (x.dtype == torch.bfloat16 and x.is_contiguous()):
            return None
        k0, v0 = kv_caches[0]
        if k0.dtype != torch.bfloat16 or md.slot_mapping.dtype != torch.int64:
            return None
        key = tuple(c.data_ptr() for kv in kv_caches for c in kv)
        if key != self._kv_key:  # caches (re)allocated: point the layers at them
            # every cache K and V alike, rows of D contiguous (head- or block-major)
            if not all(
                c.shape == k0.shape and c.stride() == k0.stride() and c.stride(2) == k0.shape[3]
                for kv in kv_caches
                for c in kv
            ):
                return None
            for desc, kv in zip(self._layers, kv_caches, strict=True):
                desc.k_cache, desc.v_cache = kv[0].data_ptr(), kv[1].data_ptr()
                desc.group = getattr(kv, "group", 0)  # a `GroupKVCache` names its group
            self._kv_key = key
        hkv_c, nb, bs, d_c = k0.shape
        bt, lens = (md.decode_block_table, md.decode_seq_lens) if nd else (None, None)
        pbt = md.prefill_block_table if md.prefills else None
        # Gemma's `embed` gives (global rope, local rope); the others one (cos, sin)
        ropes = rope if self._gemma else (rope, rope)
        (cos, sin), (cos_l, sin_l) = ((c.reshape(t, -1) for c in r) for r in ropes)
        half = self._rot // 2
        tables = (cos, sin, cos_l, sin_l)
        if hkv_c != hkv or d_c != d:
            return None
        if any(not c.is_contiguous() or c.shape[1] != half for c in tables):
            return None
        new = torch.empty  # scratch for this step
        residual = new(t, self._hidden, dtype=torch.bfloat16)
        bufs = [new(t, n, dtype=torch.bfloat16) for n in (
            self._hidden, (hq + 2 * hkv) * d, hq * d, 2 * self._inter, self._inter)]  # fmt: skip
        step = StepDesc(
            t, self._hidden, hq, hkv, d, self._inter, nb, bs, k0.stride(0), k0.stride(1),
            self._eps, self._scale,
            md.decode_num_blocks * bs, self._quant_rows,
            int(self._has_fast and fast_decode_attention()),
            # as `linear` (AVX2: `WideWeight.apply`) routes
            0 if self.batch_invariant  # the copies take every row (C: `vx_linear_apply`)
            else PANEL_FROM_ROWS - 1 if self._avx2_rows
            else VNNI_MIN_ROWS - 1 if self._linears_vnni and not self._amx
            else bf16_max_rows(),
            cos.data_ptr(), sin.data_ptr(), md.slot_mapping.data_ptr(), ptr(bt),
            bt.stride(0) if nd else 0, ptr(lens), nd, len(md.prefills),
            ptr(md.prefill_starts), ptr(md.prefill_lens), ptr(md.prefill_computed), ptr(pbt),
            pbt.stride(0) if pbt is not None else 0,
            x.data_ptr(), residual.data_ptr(), *(b.data_ptr() for b in bufs),
            ptr(keep), 0 if keep is None else keep.numel(),
            self._rot, int(self._gemma), 0, cos_l.data_ptr(), sin_l.data_ptr(),
        )  # fmt: skip
        if self._moes:
            scratch = new(moe_scratch_bytes(t, self._moes, self._hidden), dtype=torch.uint8)
            step.moe_scratch = scratch.data_ptr()
        groups = None
        if md.groups is not None:  # each layer reads its KV-cache group's slots and tables
            groups = (KVGroupDesc * len(md.groups))(*(
                KVGroupDesc(
                    g.slot_mapping.data_ptr(), ptr(g.decode_block_table if nd else None),
                    g.decode_block_table.stride(0) if nd else 0,
                    ptr(g.prefill_block_table if g.prefills else None),
                    g.prefill_block_table.stride(0) if g.prefills else 0,
                    g.decode_num_blocks * bs,
                )
                for g in md.groups
            ))  # fmt: skip
            step.groups = ctypes.addressof(groups)
        parts = self.split_parts
        if md.prefills or t < parts * self.split_min_rows or keep is not None or groups is not None:
            parts = 0
        rc = -2
        if parts:
            g = None if tail is None else ctypes.addressof(tail)
            rc = self._lib.vx_llama_decode_split(
                ctypes.addressof(self._layers), len(self._layers), ctypes.addressof(step), parts, g
            )
            self.last_parts = parts if rc != -2 else 0
        if tail is not None:  # x, cos and sin are filled in C: only the greedy calls run
            if rc == -2 and not parts:
                rc = self._lib.vx_llama_greedy_whole(
                    ctypes.addressof(self._layers), len(self._layers), ctypes.addressof(step),
                    ctypes.addressof(tail), screen_head(screen),
                )  # fmt: skip
                rc = 0 if rc == 1 else rc  # the layers ran; the screen gave no token
            if rc == -2:
                return None
            if rc != 0:
                raise MemoryError("the fused CPU decode step could not allocate scratch")
            return bufs[0], residual
        if rc == -2:
            rc = self._lib.vx_llama_decode_bf16(
                ctypes.addressof(self._layers), len(self._layers), ctypes.addressof(step)
            )
        if rc == -2:  # prefill chunks the C kernel declines now: nothing was written
            return None
        if rc != 0:
            raise MemoryError("the fused CPU decode step could not allocate scratch")
        if keep is not None:
            return x[: keep.numel()], residual[: keep.numel()]
        return x, residual

    def kept_rows(self, keep: torch.Tensor | None, t: int) -> torch.Tensor | None:
        """`keep` as `run` takes it (int64, ascending, each row below t, and routed past the
        attention as the module path routes them: not the int8 rows torch's kernel takes),
        or None (the caller then takes the module path for the step)."""
        if keep is None or keep.dtype != torch.int64 or not keep.is_contiguous():
            return None
        n = keep.numel()
        if self._int8_rows() < n <= self._quant_rows:
            return None
        if n and (int(keep[0]) < 0 or int(keep[-1]) >= t or not bool((keep[1:] > keep[:-1]).all())):
            return None
        return keep

    def greedy_takes(self, t: int, head: Any, screen: Any) -> bool:
        """Whether `greedy_step` may take a decode-only step of t rows with this head: as the
        split's parts (`head` a `VnniWeight`), or whole on the pool (`vx_llama_greedy_whole`:
        on AVX-512 builds `head`, or for one row `screen`, a `ScreenedHead` whose exact rows
        go through `vx_gemv_bf16`, `vx_gemm_vnni_bf16` or `vx_gemm_amx_bf16`; on AVX2 builds one
        row by `screen`, its exact rows through `vx_gemm_panels_avx2` or
        `vx_gemv_bf16_avx2`)."""
        if self._gemma:  # its embedding is scaled, its final norm Gemma's: not the tail's
            return False
        if self.split_parts and t >= self.split_parts * self.split_min_rows:
            return head is not None
        if self._avx2_rows:  # one row, by the screen whose exact rows take the AVX2 GEMM
            # (the panel GEMM where the head has panels, as `vx_screen_argmax` computes them)
            exact = ("vx_gemv_bf16_avx2", "vx_gemm_panels_avx2")
            return t == 1 and screen is not None and screen.exact_kernel() in exact
        if screen is not None:
            # the C tail computes the candidates as the screen does: the AMX GEMM where AMX
            # is on (`vx_screen_argmax`), else the VNNI GEMM or VDPBF16PS, as it says
            exact = ("vx_gemv_bf16", "vx_gemm_vnni_bf16", "vx_gemm_amx_bf16")
            return t == 1 and screen.exact_kernel() in exact
        return head is not None

    def greedy_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: Any,
        head: Any,
        screen: Any = None,
    ) -> tuple[torch.Tensor, np.ndarray | None] | None:
        """A decode-only step whose every row is one argmax, in one C call: the embedding
        lookup before the layers, and the final RMSNorm and the LM head's argmax after them.
        Steps the split takes run as its parts, each for its rows (`vx_greedy_tail`), the head
        the VNNI copy `head` (a `VnniWeight`); smaller ones whole on the pool
        (`vx_llama_greedy_whole`), the head `head` or, for one row, the int8 screen `screen`.
        Returns (the final normed hidden states [T, H], the tokens [T] int64, or None where
        the screen gave none: the caller forms the logits), or None, with nothing written,
        where the step is not taken (`greedy_takes`). The same kernels as
        `LlamaModel.forward` and `greedy_ids`, so the same tokens."""
        t = input_ids.shape[0]
        if md.prefills or not self.greedy_takes(t, head, screen):
            return None
        model = self._model
        embed, rotary = model.embed_tokens.weight, model.rotary
        hq, hkv, d = self._shape
        h = self._hidden
        tables = (embed, rotary.cos, rotary.sin, model.norm.weight)
        head_k, vocab = (head.k, head.n) if screen is None else screen.weight.shape[::-1]
        if (
            model.embed_tokens.tp_size != 1
            or head_k != h
            or embed.shape[1] != h
            or rotary.cos.shape[1] != self._rot // 2
            or any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in tables)
            or input_ids.dtype != torch.int64
            or positions.dtype != torch.int64
            or input_ids.shape != (t,)
            or positions.shape != (t,)
            or not (input_ids.is_contiguous() and positions.is_contiguous())
        ):
            return None
        # C reads the rows unchecked: an id or a position past its table is refused here
        # (F.embedding and the rotary's lookup raise on them on the module path).
        if int(input_ids.max()) >= embed.shape[0] or int(input_ids.min()) < 0:
            return None
        if int(positions.max()) >= rotary.cos.shape[0] or int(positions.min()) < 0:
            return None
        out = np.full(t, -1, dtype=np.int64)  # -1: no token (whole steps: the screen's)
        tail = GreedyTailDesc(
            input_ids.data_ptr(), positions.data_ptr(), embed.data_ptr(), rotary.cos.data_ptr(),
            rotary.sin.data_ptr(), model.norm.weight.data_ptr(),
            None if screen is not None else head.packed.data_ptr(), vocab, out.ctypes.data,
        )  # fmt: skip
        new = torch.empty
        x = new(t, h, dtype=torch.bfloat16)
        half = self._rot // 2
        rope = (new(t, 1, half, dtype=torch.bfloat16), new(t, 1, half, dtype=torch.bfloat16))
        done = self.run(x, rope, kv_caches, md, tail, screen=screen)
        if done is None:
            return None
        return done[0], (out if out.min() >= 0 else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: Any,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's forward (`LlamaModel.forward`: the same arguments, the same bits), with
        every layer in one C call (`run`) where it takes the step, else the model's own layer
        loop; the embedding and the final norm are the model's either way."""
        model = self._model
        x, rope = model.embed(input_ids, positions)
        kept = self.kept_rows(keep, x.shape[0])
        done = None
        # A `keep` it cannot take (rows torch's int8 kernel would take past the attention):
        # the module path, whose last layer runs on those rows alone (the same routing).
        if keep is None or kept is not None:
            done = self.run(x, rope, kv_caches, md, keep=kept)
        if done is None:  # `run` wrote nothing: the module path takes the step
            done = model.run_layers(x, rope, kv_caches, md, keep)
        return model.final_norm(*done)

    def greedy_decode_takes(self, lm_head: Any, rows: int) -> bool:
        """Whether `greedy_decode` may take a step of this many rows with this LM head (a
        `ParallelLMHead`): other steps need not be offered."""
        return self.greedy_takes(rows, lm_head.argmax_weight(rows), lm_head.argmax_screen(rows))

    def greedy_decode(
        self,
        lm_head: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: Any,
    ) -> tuple[torch.Tensor, np.ndarray | None] | None:
        """`greedy_step` with `lm_head`'s argmax copies (its VNNI copy and its int8 screen for
        this many rows): (final hidden states [T, hidden], argmax tokens [T] or None), or None
        with nothing written where that does not take the step: the caller then runs `forward`
        and the head's `greedy_ids`, which give the same."""
        t = input_ids.shape[0]
        head, screen = lm_head.argmax_weight(t), lm_head.argmax_screen(t)
        return self.greedy_step(input_ids, positions, kv_caches, md, head, screen)
