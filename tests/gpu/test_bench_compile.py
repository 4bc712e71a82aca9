"""`bench/compile.py`: its compiled side computes what HF's eager forward computes, driven as
the benchmark drives it (a `StaticCache` filled eagerly, then decode steps through the compiled
graph; a prefill on a reset cache), so the times it reports are for the real model."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from bench.compile import filled_static_cache, hf_step
from tests.models import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_compiled_side_matches_eager_decode_and_prefill(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, DynamicCache

    # inductor's generated code and its compile workers: in this test's directory, in-process
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    path = make_tiny_model(tmp_path, "llama", vocab_size=512)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    compiled = torch.compile(hf.forward, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 512, (2, 9), generator=g)
    with torch.inference_mode():
        dyn = DynamicCache()
        hf_step(hf, prompts, dyn, 0)
        static = filled_static_cache(hf, prompts, 24, reset=False)
        tok = torch.randint(3, 512, (2, 1), generator=g)
        for i in range(3):  # the graph compiles on the first step and is reused after it
            want = hf_step(hf, tok, dyn, 9 + i)
            got = hf_step(compiled, tok, static, 9 + i)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            tok = want[:, -1].argmax(-1, keepdim=True)
        # a prompt again from position 0: only on a reset cache (it counts what it holds)
        static = filled_static_cache(hf, prompts[:1], 24, reset=True)
        for _ in range(2):
            got = hf_step(compiled, prompts[:1], static, 0)
            want = hf_step(hf, prompts[:1], DynamicCache(), 0)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            static.reset()
    assert any((tmp_path / "inductor").rglob("*.cpp"))  # compiled here, not from a cache
