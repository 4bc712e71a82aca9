"""`vx.LLM` through the full process stack: EngineCore + Workers + rings, on a tiny random model.

The model is a bf16 checkpoint (`tests.models.SERVED`), so an LLM made without a dtype runs
the default path (bf16: the fused CPU step, the LM head's C argmax). There its greedy tokens
must agree with HF's in bf16 (teacher-forced, within one bf16 ulp of HF's top logit), and
prefix hits, seeded sampling, n and the KV self-check are checked. In fp32 greedy output must
equal a plain HF transformers fp32 greedy loop token for token, with and without prefix hits,
and must not change with async vs sync scheduling, a pool small enough to force preemption,
tensor parallelism, or data parallelism. Every LLM's processes and segments must be gone once
it is closed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from tests.models import SERVED, make_tiny_model  # noqa: E402
from tests.reliability.harness import alive, poll, shm_of  # noqa: E402
from vx import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PROMPTS = [
    [1, 5, 9, 13, 2, 7],
    list(range(3, 40)),
    [11] * 20 + [12, 13, 14],
    [4, 8, 15, 16, 23, 42] * 6,
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", **SERVED)


@contextlib.contextmanager
def closed_clean(path: str, **kwargs: object) -> Iterator[LLM]:
    """An LLM that must leave no process and no `vx-*` segment behind once closed (segment
    names carry their creator's pid: this process's, which creates the rings, and the LLM's
    children's)."""
    mine = {os.getpid()}
    before = shm_of(mine)
    llm = LLM(path, **kwargs)
    pids = [p.pid for p in llm._procs.processes]
    try:
        yield llm
    finally:
        llm.close()

    def left() -> tuple[list[int], set[str]]:
        return [p for p in pids if alive(p)], shm_of(mine | set(pids)) - before

    poll(lambda: not any(left()), 10)
    assert not any(left()), f"left behind after close: processes, segments {left()}"


def hf_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    # fp32 (the bf16 checkpoint's weights widened, as vx's fp32 load widens them)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            new: list[int] = []
            for _ in range(n):
                nxt = int(model(ids).logits[0, -1].argmax())
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            outs.append(new)
    return outs


def vx_generate(llm: LLM, prompts: list[list[int]], **params: object) -> list[list[int]]:
    sp = SamplingParams.create(**{"max_tokens": NEW_TOKENS, "ignore_eos": True, **params})
    return [r.outputs[0].token_ids for r in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[list[int]]:
    return hf_greedy(tiny_model, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def llm(tiny_model: str) -> Iterator[LLM]:
    """The default dtype (auto: bf16 for this checkpoint)."""
    with closed_clean(tiny_model, max_num_batched_tokens=32, num_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm_fp32(tiny_model: str) -> Iterator[LLM]:
    # fp32, kept for exact parity: token-for-token equality with HF's fp32 greedy loop. In bf16
    # the order of a GEMM's fp32 sums before the rounding (vx's C kernels against torch's, and
    # with the step's rows) moves logits by an ulp and flips near-ties, so the default dtype is
    # held to HF by agreement instead (test_bf16_greedy_agrees_with_hf).
    with closed_clean(tiny_model, dtype="float32", max_num_batched_tokens=32, num_threads=1) as llm:
        yield llm


def test_bf16_greedy_agrees_with_hf(llm: LLM, tiny_model: str) -> None:
    """The default path against HF in bf16, teacher-forced on vx's own greedy continuation
    (as tests/gpu/test_model_parity.py holds SmolLM2): at every generated position vx's token
    is HF's top-1 or within one bf16 ulp of HF's top logit (a near-tie the order of the sums
    may flip), and most are HF's top-1 exactly."""
    from transformers import AutoModelForCausalLM

    ours = vx_generate(llm, PROMPTS, temperature=0.0)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).eval()
    exact = within_ulp = 0
    for prompt, new in zip(PROMPTS, ours, strict=True):
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt + new[:-1]])).logits[0, len(prompt) - 1 :]
        best = theirs.max(-1).values
        ulp = (best.float().abs() * 2.0**-7).to(best.dtype)  # bf16 keeps 8 significant bits
        tokens = torch.tensor(new)
        exact += int((tokens == theirs.argmax(-1)).sum())
        within_ulp += int((theirs.gather(1, tokens[:, None])[:, 0] >= best - ulp).sum())
    total = NEW_TOKENS * len(PROMPTS)
    assert within_ulp == total, f"within one ulp {within_ulp}, exact {exact}, of {total}"
    assert exact >= 0.9 * total, f"exact {exact} of {total}"


def test_greedy_matches_hf(llm_fp32: LLM, reference: list[list[int]]) -> None:
    # A 32-token budget chunks the longer prompts, so chunked prefill is on the path too.
    assert vx_generate(llm_fp32, PROMPTS, temperature=0.0) == reference


def test_prefix_hits_keep_outputs(llm_fp32: LLM, reference: list[list[int]]) -> None:
    llm_fp32.call_utility("reset_prefix_cache")
    first = vx_generate(llm_fp32, PROMPTS, temperature=0.0)
    second = vx_generate(llm_fp32, PROMPTS, temperature=0.0)  # partly from the prefix cache
    assert first == second == reference
    stats = llm_fp32.call_utility("get_stats")
    assert stats["prefix_hits_total"] > 0


def test_prefix_hits_on_the_default_path(llm: LLM) -> None:
    """bf16: prefix hits serve a second run; its tokens agree with the first (a hit skips the
    cached positions' prefill, so the rest of the prompt runs in a smaller step: equal bits
    are not promised there, as they are not between bf16 and HF)."""
    llm.call_utility("reset_prefix_cache")
    first = vx_generate(llm, PROMPTS, temperature=0.0)
    hits = llm.call_utility("get_stats")["prefix_hits_total"]
    second = vx_generate(llm, PROMPTS, temperature=0.0)
    assert llm.call_utility("get_stats")["prefix_hits_total"] > hits
    pairs = zip(first, second, strict=True)
    agree = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    assert agree >= 0.9 * NEW_TOKENS * len(PROMPTS), (first, second)


def test_idle_kv_self_check(llm: LLM) -> None:
    vx_generate(llm, PROMPTS[:2], temperature=0.0)
    check = llm.call_utility("kv_self_check")
    assert check["idle"] is True
    assert not check.get("problems"), check


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    a = vx_generate(llm, PROMPTS, temperature=0.9, seed=1234)
    b = vx_generate(llm, PROMPTS[::-1], temperature=0.9, seed=1234)[::-1]
    assert a == b


def test_prompt_forms_and_bad_prompts(llm: LLM) -> None:
    """vLLM's prompt dicts and numpy ids give the plain prompts' tokens; a malformed prompt or
    an out-of-vocabulary id is a ValueError before anything is sent, and the engine lives on
    (a dict once reached it as its keys, which killed the engine)."""
    import numpy as np

    want = vx_generate(llm, PROMPTS[:2], temperature=0.0)
    forms = [{"prompt_token_ids": PROMPTS[0]}, np.array(PROMPTS[1], dtype=np.int64).tolist()]
    assert vx_generate(llm, forms, temperature=0.0) == want
    assert vx_generate(llm, [list(np.array(PROMPTS[0]))], temperature=0.0) == want[:1]
    text = llm.tokenizer.decode(PROMPTS[2])
    assert vx_generate(llm, [{"prompt": text}], temperature=0.0) == vx_generate(
        llm, [text], temperature=0.0
    )
    vocab = llm._vocab_size  # the model config's, here the tokenizer's too
    assert vocab == len(llm.tokenizer)
    bad = {
        "dict without a prompt": [{"token_ids": [1, 2]}],
        "dict with both": [{"prompt": "a", "prompt_token_ids": [1]}],
        "a string id": [[1, "2", 3]],
        "a bool id": [[1, True]],
        "a float id": [[1.0, 2.0]],
        "out of vocabulary": [[1, vocab]],
        "negative": [[-1, 2]],
        "a set": [{1, 2}],
    }
    for name, prompts in bad.items():
        with pytest.raises(ValueError, match="prompt 0"):
            vx_generate(llm, prompts, temperature=0.0)  # type: ignore[arg-type]
        assert vx_generate(llm, PROMPTS[:1], temperature=0.0) == want[:1], name


def test_stop_string_and_n(llm: LLM) -> None:
    sp = SamplingParams.create(max_tokens=8, n=3, temperature=1.0, seed=7)
    (out,) = llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    assert len(out.outputs) == 3
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)


def test_choice_i_samples_with_seed_plus_i(llm: LLM) -> None:
    """n = 3 with seed 7 is three requests with seeds 7, 8 and 9 (as over HTTP): the choices
    differ, and each is the request of its seed. PROMPTS[0] fills no KV block, so no prefix hit
    changes the second call's steps."""
    sp = SamplingParams.create(max_tokens=8, n=3, temperature=1.0, seed=7, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    choices = [o.token_ids for o in out.outputs]
    alone = [
        SamplingParams.create(max_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True)
        for i in range(3)
    ]
    each = [r.outputs[0].token_ids for r in llm.generate([PROMPTS[0]] * 3, alone, use_tqdm=False)]
    assert len({tuple(c) for c in choices}) == 3, choices
    assert choices == each


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"async_scheduling": False}, id="sync"),
        pytest.param({"num_blocks": 6, "max_num_seqs": 4}, id="preemption"),
        pytest.param({"tensor_parallel_size": 2}, id="tp2"),
        pytest.param({"pipeline_parallel_size": 2}, id="pp2"),
        pytest.param({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, id="pp2-tp2"),
        # a preemption victim may have a step in flight on a later stage
        pytest.param({"pipeline_parallel_size": 2, "num_blocks": 6, "max_num_seqs": 4},
                     id="pp2-preemption"),
        pytest.param({"data_parallel_size": 2}, id="dp2"),
        # fp32's batch-invariant path: vx's panel GEMM, every token a decode row
        pytest.param({"batch_invariant": True}, id="batch-invariant"),
    ],
)
def test_outputs_identical_across_modes(
    tiny_model: str, reference: list[list[int]], kwargs: dict[str, object]
) -> None:
    # fp32, kept for exact parity: each mode must give HF's fp32 tokens exactly (see llm_fp32;
    # these modes change the steps' rows, and with them bf16's roundings).
    with closed_clean(
        tiny_model, dtype="float32", max_num_batched_tokens=32, num_threads=1, **kwargs
    ) as llm:
        assert vx_generate(llm, PROMPTS, temperature=0.0) == reference
        if "num_blocks" in kwargs:
            assert llm.call_utility("get_stats")["num_preempted_total"] > 0


@pytest.mark.parametrize(
    ("hand_off", "kwargs"),
    [
        pytest.param("", {}, id="never"),
        pytest.param("0", {}, id="every-step"),
        pytest.param("1", {}, id="prompt-steps"),
        pytest.param("0", {"tensor_parallel_size": 2}, id="every-step-tp2"),
    ],
)
def test_pp_hand_off_gives_the_same_tokens(
    tiny_model: str,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    hand_off: str,
    kwargs: dict[str, object],
) -> None:
    """PP = 2 where stage 0 hands its last layer's o_proj, norm and MLP on to stage 1
    (`VX_PP_HAND_OFF_TOKENS`; by default on steps with prompt tokens), on no step, on every
    step: HF's fp32 tokens each time, which TP = 1 gives too (above)."""
    monkeypatch.setenv("VX_PP_HAND_OFF_TOKENS", hand_off)
    with closed_clean(tiny_model, dtype="float32", max_num_batched_tokens=32, num_threads=1,
                      pipeline_parallel_size=2, **kwargs) as llm:  # fmt: skip
        assert vx_generate(llm, PROMPTS, temperature=0.0) == reference


#: prompts that arrive while others decode (more than max_num_seqs), share a prefix, and end
#: one token past a 32-token chunk (that token alone then rides a decode step)
SHIFT_PROMPTS = [
    [1, 5, 9, 13, 2, 7],
    list(range(3, 36)),
    [11] * 20 + [12, 13, 14],
    [4, 8, 15, 16, 23, 42] * 6,
    list(range(3, 36)) + [9, 9],
    [7, 3] * 5,
    [11] * 20 + [40, 41],
    list(range(50, 61)),
]


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # four layers: 2 + 2, so stage 1 may also run stage 0's last one
    return make_tiny_model(tmp_path_factory.mktemp("deep"), arch="llama", num_hidden_layers=4,
                           **SERVED)  # fmt: skip


@pytest.mark.parametrize(
    ("hand_off", "kwargs"),
    [
        pytest.param("1", {}, id="prompt-steps"),
        pytest.param("0", {}, id="every-step"),
        pytest.param("1", {"num_blocks": 6}, id="prompt-steps-preemption"),
        pytest.param("1", {"tensor_parallel_size": 2}, id="prompt-steps-tp2"),
    ],
)
def test_pp_shift_gives_the_same_tokens(
    deep_model: str, monkeypatch: pytest.MonkeyPatch, hand_off: str, kwargs: dict[str, object]
) -> None:
    """PP = 2 where stage 1 also runs stage 0's last layer on the steps that hand off
    (`VX_PP_SHIFT_LAYERS`), both stages keeping that layer's K/V: HF's fp32 tokens, with
    steps that mix decodes and prompt chunks, prefix hits and (with a small pool)
    preemption."""
    monkeypatch.setenv("VX_PP_HAND_OFF_TOKENS", hand_off)
    monkeypatch.setenv("VX_PP_SHIFT_LAYERS", "1")
    reference = hf_greedy(deep_model, SHIFT_PROMPTS, NEW_TOKENS)
    with closed_clean(deep_model, dtype="float32", max_num_batched_tokens=32, num_threads=1,
                      max_num_seqs=4, pipeline_parallel_size=2, **kwargs) as llm:  # fmt: skip
        assert vx_generate(llm, SHIFT_PROMPTS, temperature=0.0) == reference
        stats = llm.call_utility("get_stats")
        if "num_blocks" in kwargs:
            assert stats["num_preempted_total"] > 0, stats
        else:  # (a pool this small evicts the shared blocks first)
            assert stats["prefix_hits_total"] > 0, stats


def test_pp_shift_changes_no_bits_on_the_default_path(
    deep_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 (the checkpoint's dtype, the default): moving the boundary moves whole layers and
    layer halves between processes, not arithmetic, so PP = 2 gives the same greedy tokens and
    the same logprobs of their top 3, bit for bit, with the hand-off and shift (the default),
    with the hand-off alone, and with neither."""
    sp = SamplingParams.create(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0,
                               logprobs=3)  # fmt: skip
    outputs = {}
    for name, hand_off, shift in [("shift", "1", "1"), ("hand-off", "1", "0"), ("none", "", "0")]:
        monkeypatch.setenv("VX_PP_HAND_OFF_TOKENS", hand_off)
        monkeypatch.setenv("VX_PP_SHIFT_LAYERS", shift)
        with closed_clean(deep_model, max_num_batched_tokens=32, num_threads=1, max_num_seqs=4,
                          pipeline_parallel_size=2) as llm:  # fmt: skip
            done = llm.generate(SHIFT_PROMPTS, sp, use_tqdm=False)
            outputs[name] = [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in done]
    assert outputs["shift"] == outputs["hand-off"] == outputs["none"]


def test_no_leftovers_after_close(tiny_model: str) -> None:
    before = shm_of({os.getpid()})
    llm = LLM(tiny_model, num_threads=1)
    pids = [p.pid for p in llm._procs.processes]
    llm.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # segment names carry their creator's pid: ours and the LLM's only (others share /dev/shm)
    assert shm_of({os.getpid(), *pids}) - before == set()


@pytest.fixture(scope="module")
def deeper_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # six layers: 2 + 2 + 2 under PP = 3, so the middle stage holds stage 0's last layer
    # (its shadow) and has its own last layer held by stage 2 (shadowed)
    return make_tiny_model(tmp_path_factory.mktemp("deeper"), arch="llama", num_hidden_layers=6,
                           **SERVED)  # fmt: skip


@pytest.mark.parametrize(
    ("pp", "partition", "shift", "hand_off"),
    [
        pytest.param(3, "2,2,2", "1", "1", id="pp3-prompt-steps"),
        pytest.param(3, "2,2,2", "1", "0", id="pp3-every-step"),
        pytest.param(3, "2,3,1", "2", "1", id="pp3-shift2"),
        pytest.param(2, "3,3", "2", "1", id="pp2-shift2"),
    ],
)
def test_pp_deep_shift_gives_the_same_tokens(
    deeper_model: str,
    monkeypatch: pytest.MonkeyPatch,
    pp: int,
    partition: str,
    shift: str,
    hand_off: str,
) -> None:
    """The shift on six layers: under PP = 3 a middle stage both runs its predecessor's last
    layers and has its own last layers run by the next stage, each copy's K/V kept alike, with
    the returns of two edges in flight at once; and a shift of two layers: HF's fp32 tokens."""
    monkeypatch.setenv("VX_PP_HAND_OFF_TOKENS", hand_off)
    monkeypatch.setenv("VX_PP_SHIFT_LAYERS", shift)
    monkeypatch.setenv("VX_PP_LAYER_PARTITION", partition)
    reference = hf_greedy(deeper_model, SHIFT_PROMPTS, NEW_TOKENS)
    with closed_clean(deeper_model, dtype="float32", max_num_batched_tokens=32, num_threads=1,
                      max_num_seqs=4, pipeline_parallel_size=pp) as llm:  # fmt: skip
        assert vx_generate(llm, SHIFT_PROMPTS, temperature=0.0) == reference
        assert llm.call_utility("get_stats")["prefix_hits_total"] > 0


def test_pp_shift_closes_with_returns_pending(
    deep_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last steps hand off (one token each, from long prompts), so stage 1's K/V returns of
    them are never received by stage 0: the engine still closes cleanly, and a later step
    that reads their blocks (a prefix hit on stage 0's copy) gets HF's tokens."""
    monkeypatch.setenv("VX_PP_HAND_OFF_TOKENS", "1")
    monkeypatch.setenv("VX_PP_SHIFT_LAYERS", "1")
    prompts = [list(range(3, 36)), [11] * 20 + [12, 13, 14]]
    reference = hf_greedy(deep_model, prompts, NEW_TOKENS)
    with closed_clean(deep_model, dtype="float32", max_num_batched_tokens=64, num_threads=1,
                      pipeline_parallel_size=2) as llm:  # fmt: skip
        first = vx_generate(llm, prompts, temperature=0.0, max_tokens=1)
        assert first == [r[:1] for r in reference]
        # the same prompts again: prefix hits on blocks whose stage 0 K/V are still returning
        assert vx_generate(llm, prompts, temperature=0.0) == reference
        # closed right after steps that hand off: their returns still pending
        assert vx_generate(llm, prompts, temperature=0.0, max_tokens=1) == first
