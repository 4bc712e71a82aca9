"""`vx.LLM` end to end on the families beyond Llama (issue 50): tiny random models served
through EngineCore + Workers, fp32 greedy output equal to HF's own class token for token,
with prefill chunked at 7 tokens and a second run served partly from the prefix cache; and the
default dtype (bf16 checkpoint), whose steps run the fused CPU step for the dense families
(the module path for the MoE ones), serves without error; a Qwen3-MoE model under tensor parallelism; and Gemma 2's
sliding window after preemption.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.e2e.test_llm import PROMPTS, closed_clean, hf_greedy, vx_generate  # noqa: E402
from tests.models import SERVED, make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FAMILIES = ["qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2", "gemma3"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_greedy_matches_hf_chunked_and_after_prefix_hits(tmp_path, arch: str) -> None:
    path = make_tiny_model(tmp_path, arch, seed=3, **SERVED)
    want = hf_greedy(path, PROMPTS, 12)
    with closed_clean(path, dtype="float32", max_num_batched_tokens=7, num_threads=1) as llm:
        assert vx_generate(llm, PROMPTS, temperature=0.0) == want
        assert vx_generate(llm, PROMPTS, temperature=0.0) == want  # partly from the cache
        assert llm.call_utility("get_stats")["prefix_hits_total"] > 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_default_dtype_serves(tmp_path, arch: str) -> None:
    path = make_tiny_model(tmp_path, arch, seed=4, **SERVED)
    with closed_clean(path, max_num_batched_tokens=32, num_threads=1) as llm:
        out = vx_generate(llm, PROMPTS, temperature=0.0)
    assert [len(o) for o in out] == [12] * len(PROMPTS)


def test_moe_tensor_parallel_2(tmp_path) -> None:
    """TP = 2 over gloo: each rank holds a slice of every expert; outputs all-reduced."""
    path = make_tiny_model(tmp_path, "qwen3_moe", seed=5, **SERVED)
    want = hf_greedy(path, PROMPTS, 12)
    with closed_clean(
        path, dtype="float32", max_num_batched_tokens=16, num_threads=1, tensor_parallel_size=2
    ) as llm:
        assert vx_generate(llm, PROMPTS, temperature=0.0) == want


def test_sliding_window_after_preemption(tmp_path) -> None:
    """Gemma 2 (window 8, soft-caps) with a pool small enough to preempt: recomputed requests
    give HF's tokens."""
    path = make_tiny_model(tmp_path, "gemma2", seed=6, **SERVED)
    want = hf_greedy(path, PROMPTS, 12)
    with closed_clean(
        path, dtype="float32", max_num_batched_tokens=32, num_threads=1, num_blocks=6,
        max_num_seqs=4,
    ) as llm:  # fmt: skip
        assert vx_generate(llm, PROMPTS, temperature=0.0) == want
        assert llm.call_utility("get_stats")["num_preempted_total"] > 0


def test_window_blocks_freed_greedy_matches_hf(tmp_path) -> None:
    """Every layer windowed (Mistral's kind, window 8 keys, shorter than every prompt but one):
    the KV manager frees the blocks that slide out of the window, so a 6-block pool that
    preempts when whole contexts are kept serves these four requests (12 blocks of whole
    contexts) without one preemption, chunked at 7, and again partly from the prefix cache,
    with HF's fp32 greedy tokens."""
    path = make_tiny_model(tmp_path, "mistral", seed=7, sliding_window=8, **SERVED)
    want = hf_greedy(path, PROMPTS, 12)
    with closed_clean(
        path, dtype="float32", max_num_batched_tokens=7, num_threads=1, num_blocks=6,
        max_num_seqs=4,
    ) as llm:  # fmt: skip
        assert vx_generate(llm, PROMPTS, temperature=0.0) == want
        assert vx_generate(llm, PROMPTS, temperature=0.0) == want
        stats = llm.call_utility("get_stats")
        assert stats["num_preempted_total"] == 0, stats
