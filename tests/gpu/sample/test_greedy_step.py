"""Greedy decode steps in one C call (`vx.gpu.sample.greedy.fused_greedy_step`): the embedding lookup,
every layer as the split's parts, the final norm and the LM head's argmax per part. The
tokens must be those of the model's forward and `greedy_tokens`, step by step."""

from __future__ import annotations

import types

import pytest
import torch

from tests.gpu.test_model_runner import Sim, make_runner
from tests.models import make_tiny_model
from vx.gpu.cpu.fused_step import FusedDecode
from vx.gpu.cpu.library import load_cpu_kernels
from vx.gpu.sample import greedy
from vx.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

# (arch, config overrides): head_dim 64, vocab a multiple of 16 (the VNNI copy's panels)
CASES = {
    "llama-tied": ("llama", {"hidden_size": 128, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "intermediate_size": 256,
                             "tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {"hidden_size": 128, "num_attention_heads": 4,
                             "num_key_value_heads": 2}),
    # q/k norms; a partial rotary (the tail's cos/sin rows of rotary_dim / 2)
    "qwen3": ("qwen3", {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 32}),
    "phi3-partial": ("phi3", {"hidden_size": 128, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "partial_rotary_factor": 0.5}),
}  # fmt: skip


def _split_here() -> bool:
    """Whether decode steps split here (AVX512-BF16 without AMX, two threads or more)."""
    lib = load_cpu_kernels()
    return (
        lib is not None
        and lib.vx_has_decode_step() == 1
        and not lib.vx_fast_amx(-1)
        and torch.get_num_threads() >= 2
    )


def _runner(tmp_path, case: str, calls: list, monkeypatch):
    arch, overrides = CASES[case]
    path = make_tiny_model(tmp_path / case, arch, vocab_size=512, **overrides)
    runner = make_runner(path, num_blocks=160, max_num_seqs=16, dtype="bfloat16")
    fused = runner.fused_step  # built at load, or None (no C step here: never called)
    if fused is None:
        return runner
    real = fused.greedy_decode

    def counted(*args):
        out = real(*args)
        calls.append(None if out is None else len(out[1]) if out[1] is not None else 0)
        return out

    monkeypatch.setattr(fused, "greedy_decode", counted)
    return runner


def _run(runner, params: list[SamplingParams], steps: int = 8) -> dict:
    sim = Sim(runner, num_blocks=160)
    names = [f"r{i}" for i in range(len(params))]
    for i, (name, p) in enumerate(zip(names, params, strict=True)):
        sim.add(name, [(7 * i + 13 * j) % 480 + 3 for j in range(3 + 3 * i)], params=p, eos=2)
    return sim.run(names, 64, steps)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_steps_in_one_call_give_the_forward_path_tokens(
    tmp_path, monkeypatch, case: str
) -> None:
    """12 greedy rows (prompts of 3-36 tokens), split into parts of at least one row: the
    same tokens with the one-call step and without it, and the one-call step took the decode
    steps; min_tokens rows whose argmax is masked are redone from the logits as the sampler
    masks them."""
    monkeypatch.setenv("VX_CPU_SPLIT_STEP", "2")  # read when the step is built
    monkeypatch.setenv("VX_CPU_SPLIT_MIN_ROWS", "1")
    plain = SamplingParams.create(temperature=0.0, max_tokens=64)
    outs, calls = {}, {True: [], False: []}
    for fast in (True, False):
        monkeypatch.setattr(greedy, "FUSED_STEP", fast)
        runner = _runner(tmp_path / str(fast), case, calls[fast], monkeypatch)
        first = _run(runner, [plain] * 12)
        # the tokens each row's unmasked argmax gives at its first and second outputs
        stops = sorted({t for toks in first.values() for t in toks[:2]})
        masked = SamplingParams.create(
            temperature=0.0, max_tokens=64, min_tokens=6, stop_token_ids=stops[:4]
        )
        second = _run(runner, [masked if i % 3 == 0 else plain for i in range(12)])
        outs[fast] = (first, second)
    assert outs[True] == outs[False]
    for i, toks in enumerate(outs[True][1].values()):
        if i % 3 == 0:
            assert not set(toks[:6]) & set(stops[:4]) and 2 not in toks[:6]
    assert not any(calls[False])  # switched off: never tried
    taken = [c for c in calls[True] if c]
    if not _split_here():
        assert not taken
        pytest.skip("no split decode steps here (AVX2, AMX or one thread): none was taken")
    assert taken and max(taken) == 12


def test_greedy_step_declines_what_it_does_not_cover(tmp_path, monkeypatch) -> None:
    """A row that samples, too few rows a part, and ids past the embedding table: the step is
    declined (None, nothing written) and the forward path's tokens come out."""
    if not _split_here():
        pytest.skip("no split decode steps here (AVX2, AMX or one thread)")
    monkeypatch.setenv("VX_CPU_SPLIT_STEP", "2")
    monkeypatch.setenv("VX_CPU_SPLIT_MIN_ROWS", "1")
    calls: list = []
    runner = _runner(tmp_path, "llama-tied", calls, monkeypatch)
    plain = SamplingParams.create(temperature=0.0, max_tokens=64)
    sampled = SamplingParams.create(temperature=0.8, seed=3, max_tokens=64)
    _run(runner, [plain] * 5 + [sampled], steps=4)
    assert not calls  # a sampling row: the step is not even tried
    fused = runner.fused_step
    assert isinstance(fused, FusedDecode)
    model, md = runner._model, types.SimpleNamespace(prefills=[])
    ids = torch.tensor([0, 5, 9, 7], dtype=torch.int64)
    pos = torch.tensor([0, 1, 2, 3], dtype=torch.int64)
    head = model.lm_head.argmax_weight(4)
    fused.split_min_rows = 4  # 4 rows: too few to split, so whole steps take them
    assert fused.greedy_takes(4, head, None) and not fused.greedy_takes(4, None, None)
    assert not fused.greedy_takes(8, None, model.lm_head.argmax_screen(1))  # split: a VNNI head
    fused.split_min_rows = 1
    ids[1] = 512  # past the table's rows: refused before C reads it
    assert fused.greedy_step(ids, pos, runner.kv_caches, md, head) is None
    ids[1], pos[2] = 5, model.model.rotary.cos.shape[0]  # past the rotary's table: refused too
    assert fused.greedy_step(ids, pos, runner.kv_caches, md, head) is None


def _whole_steps_both_ways(
    tmp_path, monkeypatch, rows: int, steps: int, prepare, here=None
) -> list:
    """`rows` greedy rows with the split off, with and without the one-call step (`prepare`
    called on each runner first): asserts the same tokens; the one-call runs' `calls`.
    `here`: whether this build takes whole steps (default: `_split_here`; the AVX2 build's
    tests, `tests/gpu/cpu/test_kernel_targets.py`, pass their own)."""
    monkeypatch.setenv("VX_CPU_SPLIT_STEP", "0")
    if not (here or _split_here)():
        pytest.skip("no whole greedy steps here (AVX2, AMX or one thread)")
    plain = SamplingParams.create(temperature=0.0, max_tokens=64)
    outs, calls = {}, {True: [], False: []}
    for fast in (True, False):
        monkeypatch.setattr(greedy, "FUSED_STEP", fast)
        runner = _runner(tmp_path / str(fast), "llama-tied", calls[fast], monkeypatch)
        prepare(runner)
        outs[fast] = _run(runner, [plain] * rows, steps=steps)
    assert outs[True] == outs[False]
    assert not calls[False]
    return calls[True]


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_small_greedy_steps_run_whole_in_one_call(tmp_path, monkeypatch, rows: int) -> None:
    """Steps too small to split (the split is off here) run whole on the pool: the head's
    VNNI argmax, or for one row its int8 screen. The same tokens as the forward path, and the
    one call took every decode step."""
    def check(runner):
        if rows == 1:
            assert runner._model.lm_head.argmax_screen(1) is not None  # the screen's path

    calls = _whole_steps_both_ways(tmp_path, monkeypatch, rows, 10, check)
    assert calls and all(c == rows for c in calls)


def test_screen_without_a_token_falls_back_to_the_logits(tmp_path, monkeypatch) -> None:
    """One row whose int8 screen finds too many candidates: the whole step still runs the
    layers once (its K/V written), hands back the final states without a token, and the
    logits path gives the forward path's tokens."""
    def loosen(runner):  # in place (C holds its pointer): every row is a candidate
        runner._model.lm_head.argmax_screen(1).bound[:] = 1e30

    calls = _whole_steps_both_ways(tmp_path, monkeypatch, 1, 6, loosen)
    assert calls and all(c == 0 for c in calls)  # the layers ran; no token from the screen
