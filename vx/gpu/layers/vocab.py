"""The vocabulary-parallel token embedding and LM head (the output projection), with the CPU
LM head's copies and greedy paths.

Runs in: each Worker process.

The vocabulary is split into contiguous per-rank ranges (Megatron, as the linears of
`vx.gpu.layers.linear` split their features); with `tp_size == 1` the embedding is one
`F.embedding` and the head one GEMM, no collective called. The head's logits come from a method
chain chosen once after loading, of the links the linears use (`vx.gpu.layers.linear_method`:
the plain weight for the skinny GEMM, oneDNN's or the VNNI packed copy, an fp32 or int8 copy
where the CPU wants one); for greedy rows it takes the token without forming the logits where a
C path can.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vx.gpu.cpu.ops import gemv_kernels, skinny_argmax
from vx.gpu.cpu.screen import MAX_ROWS as SCREEN_MAX_ROWS, ScreenedHead, screen_wanted
from vx.gpu.cpu.vnni import VNNI_MIN_ROWS, VnniWeight, vnni_takes, vnni_wanted
from vx.gpu.cpu.widen import WideWeight, widen_wanted
from vx.gpu.layers.linear import _all_gather_last_dim, _all_reduce
from vx.gpu.layers.linear_method import (
    LinearMethod,
    OneDnnLinear,
    QuantizedLinear,
    SkinnyLinear,
    TorchLinear,
    VnniLinear,
    WeightForms,
    WideLinear,
    batch_invariant,
    chain,
    invariant_method,
)
from vx.gpu.layers.quantization import QuantizedWeight, cpu_prepack_enabled, prepack

__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split into contiguous per-rank ranges.

    The vocab is padded up to a multiple of `tp_size`; padded rows are zero. Each rank looks up
    the ids in its range, zeroes the rest, and the ranks' outputs are summed.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.num_per_rank = math.ceil(vocab_size / tp_size)
        self.vocab_start = tp_rank * self.num_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.num_per_rank, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"expected {self.vocab_size} vocab rows, got {loaded.shape[0]}")
        rows = loaded[self.vocab_start : self.vocab_start + self.num_per_rank]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return _all_reduce(out)


class ParallelLMHead(WeightForms, VocabParallelEmbedding):
    """The output projection; shares `weight` with the embedding when tied.

    Its method chain (chosen once, after loading) asks, in order: the quantized copy (few rows),
    the VNNI copy, the skinny GEMM on the plain weight, the fp32 copies, then oneDNN's copy (a
    copy when tied: the tied weight is also the embedding's lookup table) or `F.linear`.
    """

    tied = False
    quantization: str | None = None
    screen: ScreenedHead | None = None  # an int8 copy for exact greedy tokens (one row)

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.method: LinearMethod = TorchLinear(self.weight)  # until loaded

    @property
    def packed(self) -> bool:
        """Whether `weight` itself is in oneDNN's layout (an untied head)."""
        return not self.tied and self.method.find(OneDnnLinear) is not None

    @property
    def packed_copy(self) -> torch.Tensor | None:
        """oneDNN's copy of a tied weight, or None."""
        m = self.method.find(OneDnnLinear)
        return m.packed if m is not None and self.tied else None

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.method = TorchLinear(self.weight)
        self.tied = True

    def process_weights_after_loading(self) -> None:
        w = self.weight
        if batch_invariant():  # the VNNI GEMM for every row count, and no int8 screen
            self.method = invariant_method(self)
            return
        quant = QuantizedWeight(w.data, self.quantization) if self.quantization else None
        wide = None
        if widen_wanted(w, compact=False):
            # no compact copy: the embedding's rows compress poorly, and the screen is leaner
            wide = WideWeight(w.data, compact=False)
            # Where the logits of a few rows come from the AVX2 skinny GEMM on the bf16 weight,
            # the greedy tokens can come from half its bytes (vx.gpu.cpu.screen).
            if (
                quant is None
                and self.tp_size == 1
                and wide.skinny_rows >= SCREEN_MAX_ROWS
                and screen_wanted(w)
            ):
                # the logits take the panels at every row count, so the candidates do too
                self.screen = ScreenedHead(w.data, panels=wide.panels is not None)
        plain = vnni = packed = None
        if quant is None and vnni_wanted(w):  # instead of a oneDNN copy
            plain = w.data if gemv_kernels() is not None else None
            vnni = VnniWeight(w.data)
        elif cpu_prepack_enabled(w):
            plain = w.data if gemv_kernels() is not None else None  # free when tied
            packed = prepack(w)
        self.method = chain(
            QuantizedLinear(quant) if quant is not None else None,
            VnniLinear(vnni, plain) if vnni is not None else None,
            SkinnyLinear(plain) if plain is not None else None,
            WideLinear(wide) if wide is not None else None,
            OneDnnLinear(packed) if packed is not None else TorchLinear(w),
        )
        if packed is not None and not self.tied:
            self.weight = nn.Parameter(packed, requires_grad=False)
        if plain is not None:
            self._screen_plain()

    def _screen_plain(self) -> None:
        """Where one row's logits come from an AVX-512 GEMM (`compute_logits` below: up to
        SCREEN_MAX_ROWS rows, past no quantized weight; the skinny GEMM on `plain`, or the VNNI
        copy, which takes every row count where it exists), its greedy token can come from the
        int8 screen (vx.gpu.cpu.screen), whose exact rows go through that GEMM."""
        if (
            self.screen is None
            and self.quant is None
            and self.tp_size == 1
            and self.plain is not None
            and screen_wanted(self.plain)
        ):
            # the candidates by the GEMM the logits take at one row: the VNNI copy's if any
            self.screen = ScreenedHead(self.plain, vnni=self.vnni is not None)

    def greedy_ids(self, hidden: torch.Tensor) -> np.ndarray | None:
        """[N, hidden] -> [N] int64, the argmax of `compute_logits(hidden)` (the first maximum),
        where a C kernel gets it without forming the logits (AMX; the VNNI GEMM's argmax on
        AVX512-BF16 without AMX), or from the int8 screen (one row, `vx.gpu.cpu.screen`); None
        elsewhere."""
        if self.screen is not None and self.num_per_rank == self.vocab_size:
            ids = self.screen.argmax(hidden)
            if ids is not None:
                return ids  # else (more rows, too many candidates) as without the screen
        if self.tp_size == 1 and self.num_per_rank == self.vocab_size:  # as compute_logits
            if vnni_takes(self.vnni, hidden, self.plain):
                # the argmax kernel is the VNNI GEMM's; an AMX copy's (`--batch-invariant`)
                # logits come from the AMX GEMM, and its tokens from them
                return None if self.vnni.amx else self.vnni.argmax(hidden)  # type: ignore[union-attr]
        if self.tp_size > 1 or self.plain is None or self.num_per_rank != self.vocab_size:
            return None
        if self.quant is not None and hidden.shape[0] <= self.quant.max_rows:
            return None  # compute_logits takes the quantized weight there
        return skinny_argmax(hidden, self.plain)

    def argmax_weight(self, rows: int) -> VnniWeight | None:
        """The VNNI copy `greedy_ids` takes the argmax of `rows` bf16 rows on, or None where
        it takes another path (the screen, the skinny GEMM, none)."""
        if self.screen is not None and rows <= SCREEN_MAX_ROWS:
            return None
        if self.tp_size != 1 or self.num_per_rank != self.vocab_size:
            return None
        if rows < VNNI_MIN_ROWS and self.plain is not None:  # the skinny GEMM's row
            return None
        if self.vnni is not None and self.vnni.amx:  # as `greedy_ids`: from the logits
            return None
        return self.vnni

    def argmax_screen(self, rows: int) -> ScreenedHead | None:
        """The int8 screen `greedy_ids` tries first for `rows` rows, or None."""
        if self.screen is None or rows > SCREEN_MAX_ROWS or self.num_per_rank != self.vocab_size:
            return None
        return self.screen

    def compute_logits_of(
        self, hidden: torch.Tensor, token_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """[N, hidden], [K] int64 -> [N, K] float32: the logits of those tokens only, as
        `compute_logits(hidden)[:, token_ids]` gives them up to the summation order (the same
        bf16 products, rounded to the model dtype as it rounds them). None where there is no
        plain weight to gather rows from (TP, a quantized or oneDNN-only weight), or under
        `--batch-invariant` (whose logits come from its one GEMM only).

        Why: a constrained row whose grammar allows a few tokens needs only their logits, and
        the full head streams every weight once more (a JSON answer's first token)."""
        if self.tp_size > 1 or self.quant is not None or batch_invariant():
            return None
        w = self.plain
        if w is None:
            w = self.weight if self.method.find(TorchLinear) is not None else None
        if w is None or w.is_mkldnn:
            return None
        rows = w.index_select(0, token_ids)
        return (hidden.float() @ rows.float().T).to(hidden.dtype).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (the GEMM runs in the model dtype, as HF's)."""
        logits = self.method.apply(hidden, None)
        if self.tp_size > 1:
            logits = _all_gather_last_dim(logits, self.tp_size)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return logits.float()
