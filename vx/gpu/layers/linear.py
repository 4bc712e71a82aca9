"""Building blocks shared by the model files: tensor-parallel linears, RMSNorm, SiLU-mul.

The vocabulary-parallel embedding and LM head live in `vx.gpu.layers.vocab`.

Rotary lives in `vx.gpu.layers.rotary` (re-exported here). How a linear's weight is multiplied
(the forms it keeps and the kernels that take which rows) is its method chain, chosen once after
loading (`vx.gpu.layers.linear_method`); a linear's forward is `self.method.apply`.

Runs in: each Worker process.

Tensor parallelism follows Megatron: a `ColumnParallelLinear` keeps a slice of the output
features, a `RowParallelLinear` a slice of the input features and sums the partial products
with `all_reduce`; the vocabulary is split into contiguous ranges. Each parameter carries a
`weight_loader(param, loaded, shard_id)` that cuts this rank's slice out of a full HF tensor at
load time, so no rank ever holds the full model. With `tp_size == 1` every layer is one plain
`F.linear` / `F.embedding` and no collective is called.

Numerics copy HF transformers' Llama exactly (fp32 RMSNorm, cos/sin computed in fp32 and cast
to the model dtype, rotate-half rotary, bf16 residual adds), so greedy decoding matches HF token
for token in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vx.gpu.cpu.ops import (
    fused_add_rms_norm,
    fused_gelu_tanh_and_mul,
    fused_silu_and_mul,
    head_rms_norm,
)
from vx.gpu.cpu.vnni import amx_vnni_rows
from vx.gpu.layers import triton_ops
from vx.gpu.layers.linear_method import LinearMethod, TorchLinear, WeightForms
from vx.gpu.layers.quantization import cpu_prepack_enabled
from vx.gpu.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "ColumnParallelLinear",
    "GemmaRMSNorm",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "apply_rotary",
    "cpu_prepack_enabled",
    "default_weight_loader",
    "gelu_tanh_and_mul",
    "rope_inv_freq",
    "silu_and_mul",
]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into `param`, converting dtype and device."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    from vx.gpu.parallel_state import tp_group

    dist.all_reduce(x, group=tp_group())
    return x


def _all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    import torch.distributed as dist

    from vx.gpu.parallel_state import tp_group

    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous(), group=tp_group())
    return torch.cat(parts, dim=-1)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


# ───────────────────────────── linears ─────────────────────────────


class ColumnParallelLinear(WeightForms, nn.Module):
    """y = x @ W.T + b with W's rows (output features) split evenly across ranks.

    The weight may hold several logical matrices stacked along the output dim (`output_sizes`,
    full sizes); rank r keeps slice r of each, stacked in the same order, so a fused projection
    is one GEMM whose output splits into its parts by `output_sizes_per_rank`.
    Invariant: `weight.shape == (sum(output_sizes_per_rank), input_size)`.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.output_sizes = list(output_sizes)
        self.output_sizes_per_rank = self._sizes_per_rank()
        self.quantization = quantization  # weight-only, applied after loading
        out = sum(self.output_sizes_per_rank)
        # torch.empty: the loader fills every element, so no init cost at start-up.
        self.weight = nn.Parameter(
            torch.empty(out, input_size, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out, dtype=dtype, device=device), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.method: LinearMethod = TorchLinear(self.weight)  # until loaded

    def _sizes_per_rank(self) -> list[int]:
        return [_divide(s, self.tp_size, "output features") for s in self.output_sizes]

    def process_weights_after_loading(self) -> None:
        """Called once by the loader after every weight is in place."""
        self._process()

    def _shard_rows(self, shard_id: int, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's rows of logical matrix `shard_id` (a full HF tensor)."""
        n = self.output_sizes_per_rank[shard_id]
        return loaded.narrow(0, self.tp_rank * n, n)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            if len(self.output_sizes) != 1:
                raise ValueError("a fused projection needs a shard_id per part")
            shard_id = 0
        if loaded.shape[0] != self.output_sizes[shard_id]:
            raise ValueError(
                f"part {shard_id}: expected {self.output_sizes[shard_id]} rows, got {loaded.shape[0]}"
            )
        offset = sum(self.output_sizes_per_rank[:shard_id])
        rows = self._shard_rows(shard_id, loaded)
        param.data.narrow(0, offset, rows.shape[0]).copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The output stays sharded: the next RowParallelLinear consumes it as is.
        return self.method.apply(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several same-input projections in one GEMM (gate_up_proj: [gate; up]).

    With `silu_pairs` (two equal parts, [gate; up], read through `silu_and_mul`), on AMX the
    VNNI copy is packed for the GEMM with the SiLU-mul in its epilogue (`VnniWeight(silu=True)`).
    """

    def __init__(self, *args: Any, silu_pairs: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        sizes = self.output_sizes_per_rank
        self.silu_pairs = silu_pairs and len(sizes) == 2 and sizes[0] == sizes[1]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this [gate; up] projection of x, [T, I]: one GEMM with its
        epilogue where the SiLU copy takes x's rows, else the GEMM then `silu_and_mul`."""
        v = self.vnni
        if (
            v is not None
            and v.silu
            and x.dim() == 2
            and x.dtype == torch.bfloat16
            and x.shape[0] >= amx_vnni_rows()[0]
        ):
            out = v.apply_silu(x)
            if out is not None:
                return out
        return silu_and_mul(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by attention heads.

    When there are fewer KV heads than ranks, each KV head is replicated on
    `tp_size // num_kv_heads` consecutive ranks (Megatron/vLLM convention).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        quantization: str | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = _divide(num_heads, tp_size, "attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp_size, num_kv_heads, "ranks per KV head")
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=bias,
            dtype=dtype,
            device=device,
            tp_rank=tp_rank,
            tp_size=tp_size,
            quantization=quantization,
        )

    def _sizes_per_rank(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def rope_forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """The projection of x with its q and k heads rotated (cos/sin [T, 1, head_dim / 2]),
        in one AMX GEMM with the rotary in its epilogue, where its VNNI copy takes x's rows
        (from `amx_vnni_rows()[0]` to `[1]`: the rotary pass saved outweighs oneDNN's lead
        at some sizes); else None, and the caller projects, then rotates."""
        v = self.vnni
        if v is None or not v.amx or x.dim() != 2 or x.dtype != torch.bfloat16:
            return None
        lo, hi = amx_vnni_rows()
        if not lo <= x.shape[0] <= hi:
            return None
        qk = (self.num_heads + self.num_kv_heads) * self.head_dim
        return v.apply_rope(x, self.bias, cos, sin, qk, self.head_dim)

    def _shard_rows(self, shard_id: int, loaded: torch.Tensor) -> torch.Tensor:
        if shard_id == 0:
            return super()._shard_rows(0, loaded)
        n = self.output_sizes_per_rank[shard_id]
        return loaded.narrow(0, (self.tp_rank // self.kv_replicas) * n, n)


class RowParallelLinear(WeightForms, nn.Module):
    """y = x @ W.T + b with W's columns (input features) split; partial sums are all-reduced.

    The input arrives already sharded (from a ColumnParallelLinear). The bias is added once,
    after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size_per_rank = _divide(input_size, tp_size, "input features")
        self.quantization = quantization
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_rank, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(
                torch.empty(output_size, dtype=dtype, device=device), requires_grad=False
            )
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.method: LinearMethod = TorchLinear(self.weight)  # until loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.input_size_per_rank
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def process_weights_after_loading(self) -> None:
        self._process()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.method.apply(x, self.bias)
        out = _all_reduce(self.method.apply(x, None))
        return out + self.bias if self.bias is not None else out


# ───────────────────────────── norms and activations ─────────────────────────────


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight multiply (as HF's Llama).

    `forward(x, residual)` fuses the residual add: it returns (norm(x + residual), x + residual),
    the add done in the model dtype like HF's `residual + hidden_states`.
    """

    def __init__(
        self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = triton_ops.for_tensor(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            if residual is None or residual.stride(-1) == 1:
                return ops.rms_norm(x, self.weight, self.eps, residual)
        fused = fused_add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            out, r = fused
            return out if r is None else (out, r)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def norm_heads_(self, x: torch.Tensor) -> None:
        """Normalise each head of x [T, H, D] over D (a weight of D), IN PLACE: one C call on
        CPU bf16 heads D apart in each row (`head_rms_norm`), else `forward` and a copy back;
        the same roundings either way. Qwen3's q / k norms in the qkv GEMM's own output."""
        c_kernel = type(self).forward is RMSNorm.forward  # the C norm is this class's arithmetic
        if c_kernel and x.device.type == "cpu" and head_rms_norm(x, self.weight, self.eps):
            return
        x.copy_(self(x.reshape(-1, x.shape[-1])).view(x.shape))  # type: ignore[union-attr]


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from one, `(1 + w)`, and the multiply is done in
    fp32 before the cast back (HF's Gemma2RMSNorm; Llama's casts first). `forward(x, residual)`
    fuses the residual add as RMSNorm's does, the add in the model dtype."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = fused_add_rms_norm(x, residual, self.weight, self.eps, gemma=True)
        if fused is not None:
            out, r = fused
            return out if r is None else (out, r)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate; up) -> gelu_tanh(gate) * up, [T, I] (GeGLU, HF's gelu_pytorch_tanh)."""
    fused = fused_gelu_tanh_and_mul(gate_up)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate; up) -> silu(gate) * up, [T, I]."""
    fused = fused_silu_and_mul(gate_up)
    if fused is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
