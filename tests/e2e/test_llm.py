"""`vx.LLM` through the full process stack: EngineCore + Workers + rings, on a tiny random model.

Greedy output must equal a plain HF transformers greedy loop token for token, and must not
change with async vs sync scheduling, a pool small enough to force preemption, tensor
parallelism, or data parallelism.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tests.models import make_tiny_model  # noqa: E402
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
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama")


def hf_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

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
    sp = SamplingParams.create(max_tokens=NEW_TOKENS, ignore_eos=True, **params)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[list[int]]:
    return hf_greedy(tiny_model, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def llm(tiny_model: str):
    with LLM(tiny_model, dtype="float32", max_num_batched_tokens=32, num_threads=1) as llm:
        yield llm


def test_greedy_matches_hf(llm: LLM, reference: list[list[int]]) -> None:
    # A 32-token budget chunks the longer prompts, so chunked prefill is on the path too.
    assert vx_generate(llm, PROMPTS, temperature=0.0) == reference


def test_prefix_hits_keep_outputs(llm: LLM, reference: list[list[int]]) -> None:
    llm.call_utility("reset_prefix_cache")
    first = vx_generate(llm, PROMPTS, temperature=0.0)
    second = vx_generate(llm, PROMPTS, temperature=0.0)  # served partly from the prefix cache
    assert first == second == reference
    stats = llm.call_utility("get_stats")
    assert stats["prefix_hits_total"] > 0


def test_idle_kv_self_check(llm: LLM) -> None:
    vx_generate(llm, PROMPTS[:2], temperature=0.0)
    check = llm.call_utility("kv_self_check")
    assert check["idle"] is True
    assert not check.get("problems"), check


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    a = vx_generate(llm, PROMPTS, temperature=0.9, seed=1234)
    b = vx_generate(llm, PROMPTS[::-1], temperature=0.9, seed=1234)[::-1]
    assert a == b


def test_stop_string_and_n(llm: LLM) -> None:
    sp = SamplingParams.create(max_tokens=8, n=3, temperature=1.0, seed=7)
    (out,) = llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    assert len(out.outputs) == 3
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"async_scheduling": False}, id="sync"),
        pytest.param({"num_blocks": 6, "max_num_seqs": 4}, id="preemption"),
        pytest.param({"tensor_parallel_size": 2}, id="tp2"),
        pytest.param({"data_parallel_size": 2}, id="dp2"),
    ],
)
def test_outputs_identical_across_modes(
    tiny_model: str, reference: list[list[int]], kwargs: dict[str, object]
) -> None:
    with LLM(tiny_model, dtype="float32", max_num_batched_tokens=32, num_threads=1, **kwargs) as llm:
        assert vx_generate(llm, PROMPTS, temperature=0.0) == reference
        if "num_blocks" in kwargs:
            assert llm.call_utility("get_stats")["num_preempted_total"] > 0


def test_no_leftovers_after_close(tiny_model: str) -> None:
    before = set(os.listdir("/dev/shm"))
    llm = LLM(tiny_model, dtype="float32", num_threads=1)
    pids = [p.pid for p in llm._procs.processes]
    llm.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert set(os.listdir("/dev/shm")) - before == set()
