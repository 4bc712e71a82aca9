"""`bench/step_profile.py`: the module path's ops are timed on the step they belong to, and the
profiler leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch

from bench.step_profile import OPS, build_runner, profile, report
from tests.models import make_tiny_model

pytestmark = pytest.mark.timeout(120)


def test_profile_times_every_op_of_the_module_path_and_restores_the_model(tmp_path):
    path = make_tiny_model(tmp_path, "llama", vocab_size=512)
    threads = torch.get_num_threads()
    try:
        runner = build_runner(path, 1, 64)
        import vx.gpu.layers.linear as layers_mod
        import vx.gpu.models.llama as llama_mod

        rotary, silu = llama_mod.apply_rotary, layers_mod.silu_and_mul
        results = profile(runner, 64, decodes=3, kv=20, prompts=2, prompt_len=9, repeats=2,
                          settle=False)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    mlps = [layer.mlp for layer in runner.model.model.layers]
    fused_silu = all(getattr(m.gate_up_proj.vnni, "silu", False) for m in mlps)
    fused_rope = all(
        getattr(layer.self_attn.qkv_proj.vnni, "amx", False) for layer in runner.model.model.layers
    )
    assert [r[0] for r in results] == ["decode", "prefill", "mixed"]
    for name, served, module, ops in results:
        assert len(served) == len(module) == 2 and min(served) > 0
        assert set(ops) == set(OPS)
        # each op ran on the module-path step: the hooks saw every kind of layer op
        for op in ("qkv", "o", "gate_up", "down", "attention", "norms", "rotary", "silu_mul",
                   "embedding"):  # fmt: skip
            if (op == "silu_mul" and fused_silu) or (op == "rotary" and fused_rope):
                continue  # the AMX GEMMs do the SiLU-mul and the rotary in their epilogues
            assert ops[op] > 0, (name, op)
        # the categories split the step: they add up to it, and no op's time is counted twice
        assert sum(ops.values()) <= max(module) * 1.0001
    # hooks, wrappers and the fused step are as they were (the module path's steps set the
    # fused step aside; the served steps after them must find it again)
    model = runner.model.model
    from vx.gpu.cpu.fused_step import FusedDecode

    assert (runner.fused_step is None) == (FusedDecode.build(model) is None)
    assert llama_mod.apply_rotary is rotary and layers_mod.silu_and_mul is silu
    assert all("apply_silu" not in getattr(m.gate_up_proj.vnni, "__dict__", {}) for m in mlps)
    assert all("apply_rope" not in getattr(layer.self_attn.qkv_proj.vnni, "__dict__", {})
               for layer in model.layers)  # fmt: skip
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all("timed" not in getattr(layer.self_attn.attn_fn, "__name__", "")
               for layer in model.layers)  # fmt: skip
    assert "decode" in report(results, "hdr")
