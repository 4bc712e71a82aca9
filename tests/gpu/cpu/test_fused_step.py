"""The fused CPU step (vx.gpu.cpu.fused_step) against the module path: bit-identical logits.

Each case runs the same bf16 model through two PagedDrivers over the same requests: one through the
fused step's `forward`, one through the model's own (the per-layer modules). Decode steps of 1, 2 (VDPBF16PS),
3-64 and 65-192 rows (AMX, one and two calls per GEMM) take the fused one, and so do prefill and
mixed steps of up to 192 rows (with AMX VNNI copies, up to 2,048) where the C prefill attention
takes the chunks (AMX, head size a multiple of 32); it must give the very same logits.
The dense families' blocks (Qwen3's q/k norms, Phi-4-mini's partial rotary, Gemma 2's and 3's
norms, GeGLU, windows, soft-caps and local rope) take it alike.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.gpu.conftest import PagedDriver
from tests.models import make_tiny_model
from vx.gpu.cpu.fused_step import FusedDecode
from vx.gpu.cpu.library import load_cpu_kernels, prefill_kernel_available
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
    # int4 takes the fused step on AVX2 only (vx_gemv_int4_avx2: K a multiple of 64)
    "llama-int4": ("llama", {"hidden_size": 128, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "intermediate_size": 256}, "int4"),
    # the other dense families' blocks (head_dim 32: the C prefill attention takes them)
    "qwen3": ("qwen3", {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 32}, None),
    "phi3-partial": ("phi3", {"hidden_size": 128, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "partial_rotary_factor": 0.5}, None),
    # a window of 8 keys on the first layer, soft-caps (tests.models' Gemma configs)
    "gemma2": ("gemma2", {"hidden_size": 128, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 32,
                          "query_pre_attn_scalar": 32}, None),
    "gemma3": ("gemma3", {"hidden_size": 128, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 32,
                          "query_pre_attn_scalar": 32}, None),
}  # fmt: skip


def _load(tmp_path, case: str):
    arch, overrides, quant = CASES[case]
    path = make_tiny_model(tmp_path, arch, vocab_size=512, **overrides)
    model = load_model(path, dtype=torch.bfloat16, progress=False, quantization=quant)
    fused = FusedDecode.build(model.model)
    if fused is None and quant is None and load_cpu_kernels().vx_has_decode_step():
        raise AssertionError(f"the fused step declined {case}'s blocks")
    if fused is None:
        pytest.skip("no fused CPU decode step here (AVX-512 or AVX2 kernels)")
    return model, fused


class _Counting:
    """Wraps FusedDecode.run: counts the steps it took. The entry points are FusedDecode's,
    calling this `run`; every other attribute is the wrapped step's."""

    forward, greedy_decode, greedy_step = (
        FusedDecode.forward, FusedDecode.greedy_decode, FusedDecode.greedy_step
    )

    def __init__(self, fused: FusedDecode) -> None:
        self.fused, self.taken, self.parts, self.kept = fused, 0, [], []
        self.handovers: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.fused, name)

    def run(self, *args, **kwargs):
        out = self.fused.run(*args, **kwargs)
        self.taken += out is not None
        self.kept.append(kwargs.get("keep") is not None)
        self.parts.append(self.fused.last_parts)
        split = self.fused.last_parts and out is not None
        self.handovers.append(load_cpu_kernels().vx_split_handovers() if split else 0)
        return out


def _prefill_fused(model, rows: int, max_rows: int) -> bool:
    """Whether a prefill step of `rows` rows takes the fused path (`max_rows`: its
    `max_rows()`) on this machine: AVX-512 builds only."""
    return (
        load_cpu_kernels().vx_has_decode_step() == 1
        and prefill_kernel_available()
        and model.head_dim % 32 == 0
        and rows <= max_rows
    )


def _drivers(model, fused, num_blocks: int) -> tuple[PagedDriver, PagedDriver]:
    """Two drivers of `model`: one through `fused`'s forward (a FusedDecode or a wrapper of
    it), one through the model's own (the module path)."""
    return (
        PagedDriver(model, num_blocks=num_blocks, forward=fused.forward),
        PagedDriver(model, num_blocks=num_blocks, forward=model),
    )


def _step_both(a: PagedDriver, b: PagedDriver, step: dict, keep_last=False) -> dict:
    """One step through `a` with the fused path offered and `b` without: equal logits (of each
    request's last row only, with `keep_last`)."""
    la = a.step_all(step, keep_last)
    lb = b.step_all(step, keep_last)
    for r in step:
        assert la[r].shape[0] == (1 if keep_last else len(step[r])), r
        assert torch.equal(la[r], lb[r]), r
    return {r: x[-1] for r, x in la.items()}


def _compare(
    model, fused: FusedDecode, batch: int, steps: int = 3, counting: _Counting | None = None
) -> int:
    """Prefill `batch` prompts, then decode; returns the decode steps fused (the prefill step
    is checked against `_prefill_fused`)."""
    counting = counting or _Counting(fused)
    g = torch.Generator().manual_seed(batch)
    prompts = {
        f"r{i}": torch.randint(3, 500, (int(torch.randint(1, 40, (1,), generator=g)),),
                               generator=g).tolist()
        for i in range(batch)
    }  # fmt: skip
    a, b = _drivers(model, counting, batch * 4 + 8)
    step = prompts
    for i in range(steps + 1):
        la = _step_both(a, b, step)
        if i == 0:
            rows = sum(len(p) for p in prompts.values())
            assert counting.taken == _prefill_fused(model, rows, fused.max_rows()), rows
            counting.taken = 0
        step = {r: [int(la[r].argmax())] for r in step}
    return counting.taken


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_decode_equals_module_path(tmp_path, case: str) -> None:
    model, fused = _load(tmp_path, case)
    for batch in (1, 2, 3, 17, 25):
        # past its rows (24 on AVX2) the step is declined and the module path runs
        assert _compare(model, fused, batch) == (3 if batch <= fused.max_rows() else 0), batch


def test_fused_decode_over_64_rows(tmp_path) -> None:
    """Past 64 rows each GEMM is two AMX calls (or the VDPBF16PS kernel without AMX)."""
    model, fused = _load(tmp_path, "llama-d64")
    if fused.max_rows() < 70:
        pytest.skip("the fused step takes fewer rows here (AVX2)")
    assert _compare(model, fused, 70, steps=2) == 2


@pytest.mark.parametrize(
    "case", ["llama-d64", "qwen2-bias", "llama-int8", "gemma3", "phi3-partial"]
)
def test_split_decode_steps_equal_module_path(tmp_path, monkeypatch, case: str) -> None:
    """Decode steps as two independent sub-steps (`vx_llama_decode_split`), rows cut by their
    keys (prompts of 1-39 tokens): the same logits. Where the linears have no VNNI copies
    (int8 weights, AMX) the step runs whole."""
    monkeypatch.setenv("VX_CPU_SPLIT_STEP", "2")  # read when the step is built
    monkeypatch.setenv("VX_CPU_SPLIT_MIN_ROWS", "1")
    model, fused = _load(tmp_path, case)
    if load_cpu_kernels().vx_has_decode_step() != 1 or torch.get_num_threads() < 2:
        pytest.skip("no split steps here (AVX2, or one thread)")
    assert (fused.split_parts, fused.split_min_rows) == (2, 1)
    # only on every linear's VNNI copy (not with int8 weights, not on AMX): else no split
    whole = not fused._vnni_rows or bool(load_cpu_kernels().vx_fast_amx(-1))
    # 12+ rows: with the cuts following the measured speeds (shares within [1/4, 3/4]) every
    # part keeps more than the 2 rows below which the step is run whole
    for batch in (12, 17, 70):
        if batch > fused.max_rows():
            continue
        counting = _Counting(fused)
        assert _compare(model, fused, batch, steps=2, counting=counting) == 2
        split = [p for p in counting.parts[1:] if p]  # the decode steps
        assert len(split) == (0 if whole else 2), (batch, counting.parts)
    fused.split_min_rows = 21  # 40 rows: 20 a part, too few
    counting = _Counting(fused)
    _compare(model, fused, 40, steps=1, counting=counting)
    assert counting.parts == [0, 0]


@pytest.mark.parametrize("case", ["llama-d64", "qwen2-bias"])
def test_split_hands_rows_to_the_thread_done_first(tmp_path, monkeypatch, case: str) -> None:
    """A part cut to a quarter of the rows (its thread measured a third as fast) ends first and
    takes half of the rows the other part has left, from that part's next layer on (or for the
    greedy tail): the same logits as the module path, with hand-overs; with them off, none.
    Steal mode 2 holds the part with more rows after its first layer until the other asks: on
    a loaded host the quarter part can end last, and then no rows are left to hand over."""
    monkeypatch.setenv("VX_CPU_SPLIT_STEP", "2")
    monkeypatch.setenv("VX_CPU_SPLIT_MIN_ROWS", "1")
    model, fused = _load(tmp_path, case)
    lib = load_cpu_kernels()
    if lib.vx_has_decode_step() != 1 or torch.get_num_threads() < 2:
        pytest.skip("no split steps here (AVX2, or one thread)")
    if not fused._vnni_rows or lib.vx_fast_amx(-1):
        pytest.skip("no split steps on these linears (no VNNI copies, or AMX)")
    try:
        handovers = {}
        for steal in (2, 0):
            lib.vx_set_split_steal(steal)
            parts, handovers[steal] = [], []
            for _ in range(3):  # the cut, [16, 54) rows, holds for the first decode step
                lib.vx_split_set_speeds((ctypes.c_double * 2)(1e6, 3e6), 2)
                counting = _Counting(fused)
                assert _compare(model, fused, 70, steps=2, counting=counting) == 2
                parts += counting.parts
                handovers[steal].append(counting.handovers[1])  # the first decode step's
            assert sum(1 for p in parts if p) == 6, parts
        assert handovers[0] == [0] * 3 and min(handovers[2]) >= 1, handovers
    finally:
        lib.vx_set_split_steal(1)
        lib.vx_set_split_adapt(1)  # drops the speeds set here


@pytest.mark.parametrize("keep_last", [False, True])
@pytest.mark.parametrize("case", ["llama-d64", "qwen2-bias", "qwen3", "gemma2", "gemma3"])
def test_fused_mixed_steps_equal_module_path(tmp_path, case: str, keep_last: bool) -> None:
    """Decodes, a chunk after a cached prefix and a new prompt in one step. Asked for each
    request's last row only (`keep_last`, as the ModelRunner asks), the fused step runs the
    last layer's o_proj and MLP on those rows alone: the module path's logits for them, bit for
    bit (one kept row too: the 1-row GEMMs)."""
    model, fused = _load(tmp_path, case)
    if not _prefill_fused(model, 64, fused.max_rows()):
        pytest.skip("the fused step takes no prefill chunks here (AVX2, or no C prefill kernel)")
    counting = _Counting(fused)
    g = torch.Generator().manual_seed(5)
    tok = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    steps = [
        {"a": tok(20), "b": tok(33)},
        {"a": tok(1), "b": tok(17), "c": tok(40)},  # decode, chunk after 33 cached, new prompt
        {"a": tok(1), "b": tok(1), "c": tok(9), "d": tok(1)},
        {"c": tok(5)},
    ]
    a, b = _drivers(model, counting, 40)
    for step in steps:
        _step_both(a, b, step, keep_last)
    assert counting.taken == len(steps) and all(counting.kept) == keep_last


def test_fused_decode_declines_what_it_does_not_cover(tmp_path, monkeypatch) -> None:
    model, fused = _load(tmp_path, "llama-d16")
    # a step with more rows than the skinny GEMM takes
    monkeypatch.setattr(FusedDecode, "max_rows", lambda self: 2)
    assert _compare(model, fused, 3, steps=1) == 0
    monkeypatch.undo()
    monkeypatch.setenv("VX_CPU_DECODE_STEP", "0")
    assert FusedDecode.build(model.model) is None
    monkeypatch.delenv("VX_CPU_DECODE_STEP")
    # int8 rows past the C int8 kernel's 8 that still go to a quantized kernel (torch's)
    monkeypatch.setenv("VX_QUANT_MAX_ROWS", "16")
    arch, overrides, quant = CASES["llama-int8"]
    path = make_tiny_model(tmp_path / "int8", arch, vocab_size=512, **overrides)
    model = load_model(path, dtype=torch.bfloat16, progress=False, quantization=quant)
    fused = FusedDecode.build(model.model)
    assert fused is not None
    # AVX-512: 12 rows are past the C int8 kernel's 8, so torch's takes them on the module
    # path and the step is declined; AVX2: its C int8 kernel takes up to 24 rows, fused
    assert _compare(model, fused, 12, steps=1) == (fused._int8_rows() >= 12)
    # past 16 rows: bf16, fused where the skinny GEMM takes 17 rows (AMX; 12 without)
    assert _compare(model, fused, 17, steps=1) == (1 if fused.max_rows() >= 17 else 0)


def test_kept_rows_torchs_int8_kernel_takes_go_the_module_path(tmp_path, monkeypatch) -> None:
    """Int8 weights with torch's kernel up to 10 rows (past the C kernel's 8): a 12-row step
    keeping 10 rows would route those 10 to torch's int8 kernel on the module path, so the
    fused step is not offered; the logits are the module path's."""
    monkeypatch.setenv("VX_QUANT_MAX_ROWS", "10")
    arch, overrides, quant = CASES["llama-int8"]
    path = make_tiny_model(tmp_path, arch, vocab_size=512, **overrides)
    model = load_model(path, dtype=torch.bfloat16, progress=False, quantization=quant)
    fused = FusedDecode.build(model.model)
    if fused is None or not _prefill_fused(model, 12, fused.max_rows()):
        pytest.skip("no fused int8 step with prefill chunks of 12 rows here")
    counting = _Counting(fused)
    g = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    first = {f"r{i}": tok(1) for i in range(9)}
    a, b = _drivers(model, counting, 40)
    _step_both(a, b, first, keep_last=True)
    taken = counting.taken
    _step_both(a, b, {**first, "p": tok(3)}, keep_last=True)
    assert counting.taken == taken  # 12 rows, 10 kept: not offered


def test_fused_step_hands_back_prefills_the_kernel_declines_now(tmp_path) -> None:
    """AMX switched off after the rows were counted: where the linears have no VNNI copies the
    C step answers -2 before writing anything (its GEMMs without AMX take fewer rows), `run`
    answers None and the module path gives the same logits; likewise where the gate-up has
    AMX's SiLU copy; with VNNI copies (AMX's, whose layout the VNNI GEMM without AMX takes, or
    those of a CPU without AMX) the step is taken, with the module path's logits."""
    model, fused = _load(tmp_path, "llama-d64")
    if not _prefill_fused(model, 64, fused.max_rows()):
        pytest.skip("the fused step takes no prefill chunks here (AVX2, or no C prefill kernel)")
    lib = load_cpu_kernels()
    amx = bool(lib.vx_fast_amx(-1))
    answers = []

    class _AmxOffAtRun:
        forward, kept_rows, _model = FusedDecode.forward, staticmethod(fused.kept_rows), model.model

        def run(self, *args, **kwargs):
            lib.vx_fast_amx(0)
            try:
                out = fused.run(*args, **kwargs)
            finally:
                lib.vx_fast_amx(int(amx))
            answers.append(out)
            return out

    prompt = {"a": list(range(3, 40))}
    a, b = _drivers(model, _AmxOffAtRun(), 8)
    la = a.step_all(prompt)
    lb = b.step_all(prompt)
    mlp = model.model.layers[0].mlp
    if amx and (mlp.down_proj.vnni is None or getattr(mlp.gate_up_proj.vnni, "silu", False)):
        # (a gate-up's SiLU copy is the AMX GEMM's only: without AMX the step declines)
        assert answers == [None]
    else:
        assert len(answers) == 1 and answers[0] is not None
    torch.testing.assert_close(la["a"], lb["a"], atol=0.2, rtol=0.05)


def test_runner_prefill_steps_take_the_fused_step(tmp_path) -> None:
    """Through the ModelRunner a prefill step asks for the sampled rows only (`keep`); the
    fused step still takes it (its last layer past the attention on those rows alone), with
    the module path's tokens. Without this a step of up to 192 rows ran ~14 Python-level ops a
    layer: 10-14 ms more a 32-192-token prefill for SmolLM2."""
    from tests.gpu.test_model_runner import Sim, make_runner

    arch, overrides, _ = CASES["llama-d64"]
    path = make_tiny_model(tmp_path, arch, vocab_size=512, **overrides)
    runs = {}
    for fused_on in (True, False):
        runner = make_runner(path, dtype="bfloat16")  # builds the fused step, at load
        sim = Sim(runner)
        sim.add("a", list(range(5, 45)))
        sim.add("b", list(range(7, 30)))
        sim.step({"a": 1})
        counting = None
        if fused_on:
            fused = runner.fused_step
            if fused is None or not _prefill_fused(runner._model, 64, fused.max_rows()):
                pytest.skip(
                    "the fused step takes no prefill chunks here (AVX2, or no C prefill kernel)"
                )
            runner.fused_step = counting = _Counting(fused)
        else:
            runner.fused_step = None
        plans = ({"a": 39, "b": 16}, {"a": 1, "b": 7}, {"a": 1, "b": 1})
        outs = [sim.step(plan) for plan in plans]
        runs[fused_on] = [o.sampled_token_ids for o in outs]
        if counting is not None:
            assert counting.taken == 3 and counting.kept[0]
    assert runs[True] == runs[False]


def test_amx_fused_step_takes_prompt_steps_past_192_rows(tmp_path, monkeypatch) -> None:
    """With AMX every linear has its AMX VNNI copy (the gate-up's for the SiLU epilogue), so
    the fused step takes up to `amx_vnni_rows()[1]` rows: a 250-row prompt step, with the
    module path's logits bit for bit (the same kernels); a shape whose rows the module path
    routes to oneDNN (`vnni_wins` False) sends the step to the module path."""
    from vx.gpu.cpu import fused_step as cpu_decode
    from vx.gpu.cpu.vnni import amx_vnni_rows

    model, fused = _load(tmp_path, "llama-d64")
    if not fused._amx or not _prefill_fused(model, 250, fused.max_rows()):
        pytest.skip("no AMX VNNI copies here: the fused step keeps the skinny GEMM's rows")
    assert fused.max_rows() == amx_vnni_rows()[1]
    counting = _Counting(fused)
    g = torch.Generator().manual_seed(8)
    tok = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    a, b = _drivers(model, counting, 80)
    _step_both(a, b, {"p": tok(130), "q": tok(120)})
    assert counting.taken == 1
    monkeypatch.setattr(cpu_decode, "vnni_wins", lambda n, k, m: False)
    _step_both(a, b, {"p": tok(100), "q": tok(110)})
    assert counting.taken == 1  # declined: the module path ran it


def test_split_cuts_follow_the_threads_speeds() -> None:
    """`vx_split_cut`: each part's rows x 400 + keys in proportion to its thread's measured
    speed, even until both are measured, each share kept within [1/4, 3/4] on two parts."""
    lib = load_cpu_kernels()
    if lib is None or lib.vx_has_decode_step() != 1:
        pytest.skip("no split steps here (AVX2 or no kernels)")

    def cut(lens: list[int], speeds: list[float]) -> int:
        lib.vx_split_set_speeds((ctypes.c_double * 2)(*speeds), 2)
        lens_c = (ctypes.c_int32 * len(lens))(*lens)
        out = (ctypes.c_int64 * 3)()
        lib.vx_split_cut(lens_c, len(lens), 2, out)
        assert out[0] == 0 and out[2] == len(lens)
        return out[1]

    try:
        assert cut([128] * 64, [0, 0]) == 32  # not measured yet: even
        assert cut([128] * 64, [5e6, 0]) == 32  # one unmeasured: even
        assert cut([128] * 64, [2e6, 2e6]) == 32
        assert cut([128] * 64, [3e6, 1e6]) == 48  # three times as fast: three quarters
        assert cut([128] * 64, [1e6, 3e6]) == 16
        assert cut([128] * 64, [100e6, 1e6]) == 48  # bounded at 3/4
        # 8 rows of 1,000 keys then 56 of none: half of 33,600 is rows 0-21
        assert cut([1000] * 8 + [0] * 56, [1e6, 1e6]) == 22
    finally:
        lib.vx_set_split_adapt(1)  # the speeds measured from here on


def check_batch_invariant_step(model, fused: FusedDecode) -> None:
    """A request's logits, prompt rows and decode rows, are the same bits stepped alone (its
    prompt in chunks of 7 rows) as beside 8 others of other lengths (whole prompts), through
    `fused` (built with `batch_invariant=True`) and the module path alike."""
    counting = _Counting(fused)
    g = torch.Generator().manual_seed(11)
    tok = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    # no chunk of one row: a lone prompt token takes the prefill attention in the runner
    prompts = {f"r{i}": tok(n) for i, n in enumerate((2, 5, 9, 16, 17, 31, 33, 40, 62))}
    together = PagedDriver(model, num_blocks=120, forward=counting.forward)
    alone = PagedDriver(model, num_blocks=120, forward=counting.forward)
    modules = PagedDriver(model, num_blocks=120, forward=model)
    step = prompts
    for _ in range(4):  # the prompts, then three decode steps
        got = together.step_all(step)
        for r, tokens in step.items():
            parts = [alone.step_all({r: tokens[a : a + 7]})[r] for a in range(0, len(tokens), 7)]
            assert torch.equal(got[r], torch.cat(parts)), (r, len(tokens))
        by_modules = modules.step_all(step)
        assert all(torch.equal(got[r], by_modules[r]) for r in step)
        step = {r: [int(x[-1].argmax())] for r, x in got.items()}
    assert counting.taken > 0


@pytest.mark.parametrize("case", ["llama-d64", "qwen2-bias"])
def test_batch_invariant_step_gives_a_row_the_same_bits_in_any_batch(
    tmp_path, monkeypatch, case: str
) -> None:
    """`--batch-invariant` (`set_batch_invariant` before loading): every linear has one GEMM
    for every row count (vx's AMX GEMM with AMX, else its VNNI GEMM), and the fused step
    routes every row to it (`check_batch_invariant_step`)."""
    from vx.gpu.layers import linear_method

    monkeypatch.setattr(linear_method, "_batch_invariant", True)
    arch, overrides, _ = CASES[case]
    path = make_tiny_model(tmp_path, arch, vocab_size=512, **overrides)
    try:
        model = load_model(path, dtype=torch.bfloat16, progress=False)
    except linear_method.BatchInvariantError:
        pytest.skip("no GEMM takes every row count here")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.vnni is not None and qkv.vnni.all_rows and qkv.plain is None and not qkv.packed
    fused = FusedDecode.build(model.model, batch_invariant=True)
    if fused is None:
        pytest.skip("no fused CPU decode step here")
    check_batch_invariant_step(model, fused)


@pytest.mark.parametrize("case", ["llama-d64", "qwen2-bias"])
def test_default_vnni_step_gives_a_row_the_same_bits_in_any_batch(tmp_path, case: str) -> None:
    """The default path (no `--batch-invariant`) on AVX512-BF16 without AMX: every linear's
    VNNI copy takes every row count (its small-row loop at 1-4 rows, the general loop past
    them: each output's sums in one order), so a request's logits are the same bits alone as
    in any batch, through the fused step and the module path (`check_batch_invariant_step`).
    (With AMX: the AMX GEMM up to 192 rows, tests/e2e/test_spec_decode.py; this file runs with
    AMX off natively and emulated in tests/gpu/cpu/test_emulated_isa.py.)"""
    from vx.gpu.cpu import vnni as cpu_vnni

    lib = load_cpu_kernels()
    if lib is None or not lib.vx_has_gemm_vnni() or lib.vx_fast_amx(-1):
        pytest.skip("the VNNI GEMM's default path: AVX512-BF16 with AMX off")
    arch, overrides, _ = CASES[case]
    path = make_tiny_model(tmp_path, arch, vocab_size=512, **overrides)
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.vnni is not None and not qkv.vnni.all_rows and not qkv.packed
    x = torch.randn(1, qkv.weight.shape[1]).bfloat16()
    assert cpu_vnni.vnni_takes(qkv.vnni, x, qkv.plain)  # one row too
    fused = FusedDecode.build(model.model)
    if fused is None:
        pytest.skip("no fused CPU decode step here")
    check_batch_invariant_step(model, fused)


# the MoE families (8 experts, top-2): Qwen3-MoE's bf16 renormalised weights, Mixtral's fp32 ones
MOE_CASES = {
    "qwen3_moe": ("qwen3_moe", {"hidden_size": 128, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "head_dim": 32,
                                "moe_intermediate_size": 64}),
    "mixtral": ("mixtral", {"hidden_size": 128, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "intermediate_size": 96}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_fused_moe_steps_equal_module_path(tmp_path, case: str) -> None:
    """MoE layers take the fused step where their experts take the AMX experts' GEMM (AMX,
    native or emulated) or the VNNI experts' GEMM (AVX512-BF16 without AMX, native or emulated
    with AMX off): the router, top-k, grouping, experts and weighted sum in C give the module
    path's logits bit for bit, at decode batches of 1-25 rows (those the step takes: the skinny
    GEMM's without AMX) and in mixed steps with the last layer on the kept rows alone.
    Elsewhere (AVX2) the step declines the model."""
    arch, overrides = MOE_CASES[case]
    path = make_tiny_model(tmp_path, arch, vocab_size=512, **overrides)
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    fused = FusedDecode.build(model.model)
    lib = load_cpu_kernels()
    experts = model.model.layers[0].mlp.experts.experts_fn
    amx = getattr(experts, "grouped", None) is not None
    vnni = getattr(experts, "grouped_vnni", None) is not None
    if lib is None or not lib.vx_has_decode_step() or not (amx or vnni):
        assert fused is None
        return
    assert fused is not None
    if amx:
        assert fused.max_rows() == 192
    batches = [b for b in (1, 2, 3, 7, 17, 25) if b <= fused.max_rows()]
    assert len(batches) >= 4, fused.max_rows()
    for batch in batches:
        assert _compare(model, fused, batch) == 3, batch
    if not _prefill_fused(model, 64, fused.max_rows()):
        return
    for keep_last in (False, True):
        counting = _Counting(fused)
        g = torch.Generator().manual_seed(5)

        def tok(n: int, g: torch.Generator = g) -> list[int]:
            return torch.randint(3, 500, (n,), generator=g).tolist()

        steps = [
            {"a": tok(20), "b": tok(33)},
            {"a": tok(1), "b": tok(17), "c": tok(40)},
            {"a": tok(1), "b": tok(1), "c": tok(9), "d": tok(1)},
        ]
        a, b = _drivers(model, counting, 40)
        for step in steps:
            _step_both(a, b, step, keep_last)
        assert counting.taken == len(steps)
