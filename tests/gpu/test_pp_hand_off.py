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


class _Pair:
    """A fake p2p link between stage 0 and stage 1 (one process): each stage's ops in the
    order it posts them, and the tensors in flight each way."""

    def __init__(self) -> None:
        self.ops: dict[int, list[tuple[str, tuple[int, ...]]]] = {0: [], 1: []}
        self.forward: list[torch.Tensor] = []  # stage 0 -> 1, in order
        self.back: list[torch.Tensor] = []  # stage 1 -> 0, in order
        self.received_back = 0
        self.stage = 0  # the stage running now

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vx.gpu import parallel_state as ps

        def sender(queue: list[torch.Tensor]):
            def send(tensors):
                for t in tensors:
                    self.ops[self.stage].append(("send", tuple(t.shape)))
                    queue.append(t.clone())

            return send

        send_to_next, send_to_prev = sender(self.forward), sender(self.back)

        def recv_from_prev(shapes, dtype, device):
            out = []
            for shape in shapes:
                self.ops[self.stage].append(("recv", tuple(shape)))
                t = self.forward.pop(0)
                assert tuple(t.shape) == tuple(shape)
                out.append(t)
            return out

        def irecv_from_next(shapes, dtype, device):
            handles = []
            for shape in shapes:
                self.ops[self.stage].append(("recv", tuple(shape)))
                handles.append((self.received_back, tuple(shape)))
                self.received_back += 1
            return handles

        def wait_recv(handles):
            out = []
            for i, shape in handles:
                t = self.back[i]  # sent by now: stage 1 ran that step
                assert tuple(t.shape) == shape
                out.append(t)
            return out

        for name, fn in [("send_to_next", send_to_next), ("recv_from_prev", recv_from_prev),
                         ("send_to_prev", send_to_prev), ("irecv_from_next", irecv_from_next),
                         ("wait_recv", wait_recv)]:  # fmt: skip
            monkeypatch.setattr(ps, name, fn)


def _shift_run(path: str, monkeypatch: pytest.MonkeyPatch, eager: bool):
    """Both `PipelineStage`s of a PP = 2 shift over a fake link, through steps that hand off
    (prompts) and steps that do not (decodes, some over blocks whose K/V a step before
    computed on stage 1 only). `eager`: stage 0 takes every return before a step that runs
    the shadowed layer. Returns (stage 1's output of each step, the link, the stages, their
    caches, {request: (blocks, length)})."""
    import numpy as np

    from vx.config import BLOCK_SIZE
    from vx.gpu import parallel_state as ps, pipeline_stage
    from vx.gpu.attention.paged import build_attention_metadata
    from vx.gpu.kv_cache import allocate_kv_caches
    from vx.gpu.pipeline_stage import PipelineStage

    with monkeypatch.context() as mp:
        models = _stages(path, mp, shift=1)
        pair = _Pair()
        pair.install(mp)
        if eager:
            mp.setattr(pipeline_stage, "_reads", lambda md, blocks: True)
        stages, caches = [], []
        for r, m in enumerate(models):
            mp.setattr(ps, "grid", lambda r=r: ps.Grid(pp_size=2, pp_rank=r))
            stages.append(PipelineStage(m, torch.float32, torch.device("cpu")))
            caches.append(allocate_kv_caches(m.num_layers, 16, m.num_kv_heads, m.head_dim,
                                             dtype=torch.float32, device="cpu"))  # fmt: skip
        assert (stages[0].shadowed, stages[1].shadows) == (1, 1)
        blocks = {"a": [3, 4], "b": [7, 8], "c": [5]}
        lens = {"a": 0, "b": 0, "c": 0}
        g = torch.Generator().manual_seed(0)
        outputs = []

        def step(new: dict[str, int]) -> None:
            """One step of `new` tokens per request (decodes first), run by stage 0 then 1."""
            ids = list(new)
            q = np.array([new[i] for i in ids])
            done = np.array([lens[i] for i in ids])
            table = np.zeros((len(ids), 2), np.int32)
            slots = []
            for j, i in enumerate(ids):
                table[j, : len(blocks[i])] = blocks[i]
                for p in range(lens[i], lens[i] + new[i]):
                    slots.append(blocks[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            positions = torch.from_numpy(
                np.concatenate([np.arange(n, n + k) for n, k in zip(done, q, strict=True)])
            )
            tokens = torch.randint(0, 64, (int(q.sum()),), generator=g)
            for r in range(2):
                md = build_attention_metadata(
                    query_lens=q, num_computed=done, block_table=table,
                    slot_mapping=np.array(slots, np.int64), num_decodes=int((q == 1).sum()),
                )  # fmt: skip
                pair.stage = r
                out = stages[r].forward(tokens, positions, caches[r], md, None,
                                        int(q[q > 1].sum()))  # fmt: skip
            outputs.append(out)
            for i in ids:
                lens[i] += new[i]

        step({"a": 5})  # hands off: stage 1 computes a's K/V of layer 1 and sends it back
        step({"b": 20})  # hands off; a's return still pending on stage 0
        step({"a": 1})  # a decode over a's block: takes a's return (older than the step before)
        step({"b": 1, "c": 4})  # hands off; b's return of the step before not read: pending
        step({"b": 1, "a": 1})  # decodes over b's blocks, which the step before also wrote
        step({"c": 1})  # over c's block, written two steps back
        return outputs, pair, stages, caches, {i: (blocks[i], lens[i]) for i in blocks}


def test_shift_keeps_both_copies_alike_and_posts_p2p_in_one_order(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PP = 2 with the shift, both `PipelineStage`s in one process over a fake link: stage 0
    takes the returns late yet computes what it would have taken them all at once, its copy
    of the shadowed layer and stage 1's shadow copy end alike, and the two stages post their
    ops on the link in the same order (a send where the other receives): NCCL runs both
    directions' ops between two ranks in one stream, so any other order can deadlock there."""
    from vx.config import BLOCK_SIZE

    path = make_tiny_model(tmp_path, "llama", num_hidden_layers=4)
    want, *_ = _shift_run(path, monkeypatch, eager=True)
    got, pair, stages, caches, reqs = _shift_run(path, monkeypatch, eager=False)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    assert len(stages[0].returning) == 0
    theirs = [(("recv" if op == "send" else "send"), shape) for op, shape in pair.ops[1]]
    assert pair.ops[0] == theirs
    (k0, v0), (k1, v1) = caches[0][-1], caches[1][0]  # layer 1 on each stage
    for blocks, n in reqs.values():
        for p in range(n):
            b, o = blocks[p // BLOCK_SIZE], p % BLOCK_SIZE
            assert torch.equal(k0[:, b, o], k1[:, b, o]) and torch.equal(v0[:, b, o], v1[:, b, o])
            assert k0[:, b, o].abs().sum() > 0
