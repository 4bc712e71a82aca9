"""The fused CPU decode step (vx.gpu.cpu_decode) against the module path: bit-identical logits.

Each case runs the same bf16 model through two PagedDrivers over the same requests: one with the
fused step, one with it switched off (the per-layer modules). Prefill steps always take the
module path; decode steps of 1, 2 (VDPBF16PS), 3-64 and 65-192 rows (AMX, one and two calls per
GEMM) take the fused one, which must give the very same logits.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import PagedDriver
from tests.models import make_tiny_model
from vx.gpu.cpu_decode import FusedDecode
from vx.gpu.loader import load_model

pytestmark = pytest.mark.timeout(300)

# (arch, config overrides, quantization)
CASES = {
    "llama-d16": ("llama", {}, None),  # head_dim 16: the portable attention kernel
    "llama-d64": ("llama", {"hidden_size": 128, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "intermediate_size": 256}, None),
    "qwen2-bias": ("qwen2", {"hidden_size": 128, "num_attention_heads": 4,
                             "num_key_value_heads": 2}, None),
    "llama-int8": ("llama", {"hidden_size": 128, "num_attention_heads": 2,
                             "num_key_value_heads": 1}, "int8"),
}  # fmt: skip


def _load(tmp_path, case: str):
    arch, overrides, quant = CASES[case]
    path = make_tiny_model(tmp_path, arch, vocab_size=512, **overrides)
    model = load_model(path, dtype=torch.bfloat16, progress=False, quantization=quant)
    fused = FusedDecode.build(model.model)
    if fused is None:
        pytest.skip("no fused CPU decode step here (needs the AVX-512 kernel library)")
    return model, fused


class _Counting:
    """Wraps FusedDecode.run: counts the steps it took."""

    def __init__(self, fused: FusedDecode) -> None:
        self.fused, self.taken = fused, 0

    def run(self, *args):
        out = self.fused.run(*args)
        self.taken += out is not None
        return out


def _compare(model, fused: FusedDecode, batch: int, steps: int = 3) -> int:
    """Prefill `batch` prompts, then decode; returns the fused steps taken."""
    counting = _Counting(fused)
    g = torch.Generator().manual_seed(batch)
    prompts = {
        f"r{i}": torch.randint(3, 500, (int(torch.randint(1, 40, (1,), generator=g)),),
                               generator=g).tolist()
        for i in range(batch)
    }  # fmt: skip
    a, b = PagedDriver(model, num_blocks=batch * 4 + 8), PagedDriver(model, num_blocks=batch * 4 + 8)
    step = prompts
    for _ in range(steps + 1):
        model.model.fused_decode = counting
        la = a.step(step)
        model.model.fused_decode = None
        lb = b.step(step)
        for r in step:
            assert torch.equal(la[r], lb[r]), r
        step = {r: [int(la[r].argmax())] for r in step}
    return counting.taken


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_decode_equals_module_path(tmp_path, case: str) -> None:
    model, fused = _load(tmp_path, case)
    for batch in (1, 2, 3, 17):
        assert _compare(model, fused, batch) == 3, batch  # the prefill step is not fused


def test_fused_decode_over_64_rows(tmp_path) -> None:
    """Past 64 rows each GEMM is two AMX calls (or the VDPBF16PS kernel without AMX)."""
    model, fused = _load(tmp_path, "llama-d64")
    assert _compare(model, fused, 70, steps=2) == 2


def test_fused_decode_declines_what_it_does_not_cover(tmp_path, monkeypatch) -> None:
    model, fused = _load(tmp_path, "llama-d16")
    # prefill and mixed steps: the module path (counted as not taken above); here a step with
    # more rows than the skinny GEMM takes
    import vx.gpu.cpu_decode as cd

    monkeypatch.setattr(cd, "bf16_max_rows", lambda: 2)
    assert _compare(model, fused, 3, steps=1) == 0
    monkeypatch.undo()
    # int8 rows past the C int8 kernel's 8 that still go to a quantized kernel (torch's)
    monkeypatch.setenv("VX_QUANT_MAX_ROWS", "16")
    model, fused = _load(tmp_path, "llama-int8")
    assert _compare(model, fused, 12, steps=1) == 0
    assert _compare(model, fused, 17, steps=1) == 1  # past 16 rows: bf16, fused
    monkeypatch.setenv("VX_CPU_DECODE_STEP", "0")
    assert FusedDecode.build(model.model) is None
