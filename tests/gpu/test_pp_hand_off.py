"""Pipeline parallel's hand-off (`VX_PP_HAND_OFF_TOKENS`): a stage that stops its last layer
after the attention, and the next stage finishing that layer from its copy of the layer's
o_proj, norm and MLP, give exactly the whole model's logits and greedy tokens (fp32, both
stages in one process over the module path, no torch.distributed); so does the shift
(`VX_PP_SHIFT_LAYERS`), where the next stage also runs the earlier stage's last layer whole
(here over the same KV cache; the processes' copies are kept alike by `PipelineStage`, which
tests/e2e check). Gemma's layers, which have no `finish`, hand nothing off."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.gpu.conftest import PagedDriver  # noqa: E402
from tests.gpu.test_model_parity import PROMPTS  # noqa: E402
from tests.models import make_tiny_model  # noqa: E402
from vx.gpu.loader import load_model  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "qwen3", "mixtral"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    # Qwen3: q/k norms in the attention, which the copy leaves out; Mixtral: experts
    return make_tiny_model(tmp_path_factory.mktemp("pp"), request.param, num_hidden_layers=4)


def _stages(path: str, monkeypatch: pytest.MonkeyPatch, shift: int = 0) -> list[torch.nn.Module]:
    monkeypatch.setenv("VX_PP_HAND_OFF_TOKENS", "1")
    monkeypatch.setenv("VX_PP_SHIFT_LAYERS", str(shift))
    return [load_model(path, dtype=torch.float32, pp_rank=r, pp_size=2, progress=False)
            for r in range(2)]  # fmt: skip


def _pipelined(stages: list[torch.nn.Module], hand_off: bool):
    """The two stages' forward over one list of KV caches (stage 0's layers first; stage 1's
    shadow layers take stage 0's caches of those layers)."""
    m0, m1 = (s.model for s in stages)

    def forward(ids, positions, kv_caches, md, keep=None):
        n0 = stages[0].num_layers
        x, rope = m0.embed(ids, positions)
        x, res = m0.run_layers(x, rope, kv_caches[:n0], md, None, hand_off=hand_off)
        x, res = m1.run_layers(x, m1.rope(positions), kv_caches[n0 - m1.shadow_layers :], md,
                               keep, res, finish_prev=hand_off)  # fmt: skip
        return m1.final_norm(x, res)

    return forward


@pytest.mark.parametrize("shift", [0, 1])
def test_the_copy_holds_the_layer_tail_only(
    tiny: str, monkeypatch: pytest.MonkeyPatch, shift: int
) -> None:
    s0, s1 = _stages(tiny, monkeypatch, shift)
    assert (s0.model.shadowed_layers, s1.model.shadow_layers) == (shift, shift)
    tail = s1.model.tail_layer
    assert tail == s0.model.end_layer - 1 - shift == s1.model.cache_start - 1
    assert s1.model.cache_start == s1.model.start_layer - shift
    assert s1.num_layers == s1.model.end_layer - s1.model.start_layer + shift  # its KV caches
    assert s0.model.tail_layer is None
    names = {n for n, _ in s1.named_parameters() if n.startswith(f"model.layers.{tail}.")}
    assert any(".o_proj." in n for n in names) and any("post_attention" in n for n in names)
    assert not any(".qkv_proj." in n or "_norm." in n or "input_layernorm" in n for n in names)
    for layer in range(tail + 1, s1.model.start_layer):  # the shadow layers: whole
        whole = {n for n, _ in s0.named_parameters() if n.startswith(f"model.layers.{layer}.")}
        assert whole and whole <= {n for n, _ in s1.named_parameters()}
    monkeypatch.setenv("VX_PP_HAND_OFF_TOKENS", "")  # never
    plain = load_model(tiny, dtype=torch.float32, pp_rank=1, pp_size=2, progress=False)
    assert plain.model.tail_layer is None and plain.model.shadow_layers == 0


@pytest.mark.parametrize(("hand_off", "shift"), [(False, 0), (True, 0), (False, 1), (True, 1)])
def test_hand_off_gives_the_whole_models_tokens(
    tiny: str, monkeypatch: pytest.MonkeyPatch, hand_off: bool, shift: int
) -> None:
    whole = load_model(tiny, dtype=torch.float32, progress=False)
    stages = _stages(tiny, monkeypatch, shift)
    want = PagedDriver(whole, forward=whole)
    got = PagedDriver(whole, forward=_pipelined(stages, hand_off))  # whole's head: the same
    # a prefill of several prompts, then a chunk beside decodes, then decodes
    batches = [dict(list(PROMPTS.items())[:3]), {"short": [12], "long": [13], "repeat": [1] * 9}]
    batches += [{"short": [14], "long": [15], "repeat": [16]}] * 3
    for i, batch in enumerate(batches):
        keep_last = i == 2  # the last stage's last layer on the sampled rows alone
        a, b = want.step_all(batch, keep_last), got.step_all(batch, keep_last)
        for req_id in batch:
            assert torch.equal(a[req_id], b[req_id]), req_id
    assert got.greedy({"x": PROMPTS["long"]}, 8) == want.greedy({"x": PROMPTS["long"]}, 8)


def test_gemma_hands_nothing_off(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(tmp_path, "gemma2")  # two layers: one a stage
    s0, s1 = _stages(path, monkeypatch)
    assert not s1.hands_off_tails() and s1.model.tail_layer is None
