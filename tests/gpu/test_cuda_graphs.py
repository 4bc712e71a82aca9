"""CUDA-graph decode: capture sizes, padding, and the replay plumbing, all on CPU.

The graphs themselves need CUDA (tests/gpu/test_gpu_marked.py); everything around them runs
here: the 51 capture sizes and the pad-up rule, the device-agnostic refill of the static
buffers, the padding contract against the Triton kernels' references (and, in a fresh
interpreter, against the kernels themselves under TRITON_INTERPRET=1), and the whole
`CudaGraphRunner` inside a `ModelRunner` with the CPU stand-in for a graph (a replay reruns
the captured forward over the same static buffers). Also: the GPU model path dispatches
RMSNorm and rotary to the Triton wrappers.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from tests.gpu.conftest import PagedDriver
from tests.models import make_tiny_model
from vx.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vx.gpu.attention.paged import build_attention_metadata
from vx.gpu.attention.triton import (
    paged_attention_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    write_kv_cache_ref,
)
from vx.gpu.cuda_graphs import (
    PAD_SLOT_ID,
    CudaGraphRunner,
    StaticDecodeInputs,
    capture_cuda_graphs,
    cudagraph_capture_sizes,
    fill_padded_decode_inputs,
    padded_batch_size,
)
from vx.gpu.layers import triton_ops
from vx.gpu.model_runner import ModelRunner
from vx.messages import CachedRequestData, NewRequestData, SchedulerOutput
from vx.sampling_params import SamplingParams

BS = 16
GREEDY = SamplingParams.create(temperature=0.0, max_tokens=64)

# ───────────────────────────── sizes and padding ─────────────────────────────


def test_capture_sizes_default_51():
    sizes = cudagraph_capture_sizes(1024)
    assert len(sizes) == 51
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[3:34] == list(range(8, 256, 8))
    assert sizes[34:] == list(range(256, 513, 16))
    assert cudagraph_capture_sizes(256) == sizes  # min(2 x 256, 512) = 512
    assert cudagraph_capture_sizes(4) == [1, 2, 4, 8]
    assert cudagraph_capture_sizes(64) == [1, 2, 4, *range(8, 129, 8)]
    assert cudagraph_capture_sizes(1024, max_size=40)[-1] == 40


def test_padded_batch_size():
    sizes = cudagraph_capture_sizes(1024)
    assert padded_batch_size(37, sizes) == 40
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert padded_batch_size(248, sizes) == 248
    assert padded_batch_size(249, sizes) == 256
    assert padded_batch_size(257, sizes) == 272
    assert padded_batch_size(512, sizes) == 512
    assert padded_batch_size(513, sizes) is None
    assert padded_batch_size(0, sizes) is None
    for n in range(1, 513):
        p = padded_batch_size(n, sizes)
        assert p >= n and not any(n <= s < p for s in sizes)


def _decode_batch(b, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        input_ids=torch.randint(1, 100, (b,), generator=g),
        positions=torch.randint(1, 50, (b,), generator=g),
        slot_mapping=torch.randint(0, 400, (b,), generator=g),
        seq_lens=torch.randint(1, 50, (b,), generator=g).int(),
        block_table=torch.randint(0, 25, (b, width), generator=g).int(),
    )


def test_fill_padded_overwrites_stale_rows():
    static = StaticDecodeInputs.allocate(8, 4, "cpu")
    md = static.metadata(8)  # views: refills after this are what it reads
    big = _decode_batch(8, 4, seed=1)
    fill_padded_decode_inputs(static, 8, **big)
    assert torch.equal(md.slot_mapping, big["slot_mapping"])
    small = _decode_batch(5, 2, seed=2)
    fill_padded_decode_inputs(static, 8, **small)
    assert torch.equal(static.input_ids[:5], small["input_ids"])
    assert torch.equal(static.positions[:5], small["positions"])
    assert torch.equal(static.slot_mapping[:5], small["slot_mapping"])
    assert torch.equal(static.seq_lens[:5], small["seq_lens"])
    assert torch.equal(static.block_table[:5, :2], small["block_table"])
    # Rows [5, 8) were a real batch's: now padding that writes and reads no KV.
    assert md.slot_mapping[5:].tolist() == [PAD_SLOT_ID] * 3
    assert md.seq_lens[5:].tolist() == [0] * 3
    assert static.input_ids[5:].tolist() == [0] * 3 and static.positions[5:].tolist() == [0] * 3
    assert md.query_start_loc.tolist() == list(range(9))
    assert md.tile_req.tolist() == list(range(8)) and md.tile_q_start.tolist() == [0] * 8
    with pytest.raises(ValueError):
        fill_padded_decode_inputs(static, 4, **small)  # 5 rows do not fit size 4
    with pytest.raises(ValueError):
        fill_padded_decode_inputs(static, 8, **_decode_batch(2, 5))  # wider than the buffers


def _paged_decode(b, hkv=2, g=3, d=32, num_blocks=40, seed=0):
    """A random decode batch of b requests over a random paged cache (fp32)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    ctx = rng.integers(1, 60, size=b)
    nblk = -(-ctx // BS)
    perm = rng.permutation(num_blocks)
    bt = np.zeros((b, int(nblk.max())), np.int32)
    off = 0
    for i, n in enumerate(nblk):
        bt[i, :n] = perm[off : off + n]
        off += n
    pos = ctx - 1
    slots = bt[np.arange(b), pos // BS].astype(np.int64) * BS + pos % BS
    md = build_attention_metadata(
        query_lens=np.ones(b, np.int64),
        num_computed=pos,
        block_table=bt,
        slot_mapping=slots,
        num_decodes=b,
        for_triton=True,
    )
    kc = torch.randn(hkv, num_blocks, BS, d, generator=gen)
    vc = torch.randn(hkv, num_blocks, BS, d, generator=gen)
    q = torch.randn(b, hkv * g, d, generator=gen)
    k = torch.randn(b, hkv, d, generator=gen)
    v = torch.randn(b, hkv, d, generator=gen)
    return md, kc, vc, q, k, v


def test_padding_contract_with_kernel_references():
    """A batch of 5 padded to 8: the padded run writes exactly the 5 real slots and gives the
    5 real rows the unpadded outputs; padding rows come out as zeros."""
    md, kc, vc, q, k, v = _paged_decode(5)
    kc_a, vc_a = kc.clone(), vc.clone()
    write_kv_cache_ref(k, v, kc_a, vc_a, md.slot_mapping)
    want = paged_attention_ref(q, kc_a, vc_a, md, 0.2)

    static = StaticDecodeInputs.allocate(8, 6, "cpu")
    fill_padded_decode_inputs(static, 8, *_decode_batch(8, 6).values())  # stale rows
    fill_padded_decode_inputs(
        static, 8, torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long),
        md.slot_mapping, md.seq_lens, md.block_table,
    )  # fmt: skip
    pmd = static.metadata(8)
    pad = torch.full((3, *q.shape[1:]), 7.0)
    kc_b, vc_b = kc.clone(), vc.clone()
    kpad = torch.full((3, *k.shape[1:]), 9.0)
    write_kv_cache_ref(torch.cat([k, kpad]), torch.cat([v, kpad]), kc_b, vc_b, pmd.slot_mapping)
    got = paged_attention_ref(torch.cat([q, pad]), kc_b, vc_b, pmd, 0.2)
    assert torch.equal(kc_a, kc_b) and torch.equal(vc_a, vc_b)
    assert torch.equal(got[:5], want)
    assert torch.count_nonzero(got[5:]) == 0


_KERNEL_SCRIPT = r"""
import torch
from tests.gpu.test_cuda_graphs import _paged_decode, _decode_batch
from vx.gpu.attention import triton as ta
from vx.gpu.cuda_graphs import StaticDecodeInputs, fill_padded_decode_inputs
md, kc, vc, q, k, v = _paged_decode(5, seed=4)
kc_a, vc_a = kc.clone(), vc.clone()
ta.write_kv_cache_ref(k, v, kc_a, vc_a, md.slot_mapping)
want = ta.paged_attention_ref(q, kc_a, vc_a, md, 0.2)
static = StaticDecodeInputs.allocate(8, 6, "cpu")
fill_padded_decode_inputs(static, 8, *_decode_batch(8, 6).values())
z = torch.zeros(5, dtype=torch.long)
fill_padded_decode_inputs(static, 8, z, z, md.slot_mapping, md.seq_lens, md.block_table)
pmd = static.metadata(8)
kpad = torch.full((3, *k.shape[1:]), 9.0)
kc_b, vc_b = kc.clone(), vc.clone()
ta.write_kv_cache(torch.cat([k, kpad]), torch.cat([v, kpad]), kc_b, vc_b, pmd.slot_mapping)
got = ta.paged_attention(torch.cat([q, torch.full((3, *q.shape[1:]), 7.0)]), kc_b, vc_b, pmd, 0.2)
assert torch.equal(kc_a, kc_b) and torch.equal(vc_a, vc_b)
torch.testing.assert_close(got[:5], want, atol=1e-4, rtol=1e-4)
assert torch.count_nonzero(got[5:]) == 0
print("PADDED-KERNELS-OK")
"""


def test_padding_contract_with_triton_kernels_interpreted():
    """The same contract through the Triton kernels themselves (TRITON_INTERPRET=1, in a fresh
    interpreter: the mode must be chosen before triton is imported)."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-c", _KERNEL_SCRIPT],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert "PADDED-KERNELS-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# ───────────────────────────── the runner, end to end on CPU ─────────────────────────────


def _ref_attention(q, k, v, kv_cache, md, scale):
    """The Triton kernels' references: the metadata a graph builds is Triton-shaped."""
    write_kv_cache_ref(k, v, kv_cache[0], kv_cache[1], md.slot_mapping)
    return paged_attention_ref(q, kv_cache[0], kv_cache[1], md, scale)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("graphs"), "llama")


def _runner(path, ref_attention: bool, graph_sizes=None, speculative=None) -> ModelRunner:
    """`speculative`: drafts handed to each step by the test (async scheduling off)."""
    config = EngineConfig(
        model=ModelConfig(path=path, dtype="float32", max_model_len=256),
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=256, async_scheduling=speculative is None
        ),
        cache=CacheConfig(num_blocks_override=64),
        speculative=speculative or SpeculativeConfig(),
    )
    config.validate()
    runner = ModelRunner(config, device="cpu")
    runner.load_model()
    runner.initialize_kv_cache(64)
    assert runner.cuda_graphs is None  # CPU: no graphs unless a test installs them
    if ref_attention:
        for layer in runner.model.model.layers:
            layer.self_attn.attn_fn = _ref_attention
    if graph_sizes:
        max_blocks = math.ceil(runner.max_model_len / BS)
        runner.cuda_graphs = CudaGraphRunner(
            runner.model, runner.kv_caches, graph_sizes, max_blocks, "cpu"
        )
        runner.cuda_graphs.capture()
    return runner


def _admit(reqs: dict[str, dict], free: list[int], rid: str, prompt: list[int]) -> NewRequestData:
    """A new request's blocks for its whole prompt (from `free`), its record in `reqs`, and
    its NewRequestData."""
    blocks = [free.pop() for _ in range(math.ceil(len(prompt) / BS))]
    reqs[rid] = dict(tokens=list(prompt), computed=0, blocks=blocks)
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=GREEDY,
        block_ids=list(blocks),
        num_computed_tokens=0,
        output_token_ids=[],
        eos_token_id=None,
    )


def _step(
    step_id: int,
    news: list[NewRequestData],
    cached: list[tuple[str, list[int], int]],
    sched: dict[str, int],
    finished: list[str],
    spec: dict[str, list[int]] | None = None,
) -> SchedulerOutput:
    """A step of new requests and cached ones ((id, new blocks, computed count) each)."""
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=news,
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[c[0] for c in cached],
            new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=sched,
        total_num_scheduled_tokens=sum(sched.values()),
        finished_req_ids=finished,
        scheduled_spec_decode_tokens=spec or {},
    )


class _Sim:
    """Hands the runner SchedulerOutputs: whole-prompt prefills, then one token a step."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.free = list(range(64))[::-1]
        self.reqs: dict[str, dict] = {}
        self.step_id = 0
        self.finished: list[str] = []

    def step(self, new: dict[str, list[int]], decode: list[str]) -> dict[str, int]:
        news, cached, sched = [], [], {}
        for rid, prompt in new.items():
            news.append(_admit(self.reqs, self.free, rid, prompt))
            sched[rid] = len(prompt)
        for rid in decode:
            r = self.reqs[rid]
            fresh = []
            if len(r["tokens"]) > len(r["blocks"]) * BS:
                fresh = [self.free.pop()]
                r["blocks"] += fresh
            cached.append((rid, fresh, r["computed"]))
            sched[rid] = 1
        so = _step(self.step_id, news, cached, sched, self.finished)
        self.finished = []
        self.step_id += 1
        out = self.runner.execute(so)
        result = {}
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            r = self.reqs[rid]
            r["computed"] += sched[rid]
            r["tokens"] += toks
            result[rid] = toks[0]
        return result

    def run(self) -> dict[str, list[int]]:
        """Prefill a, b, c; decode 3 (pads to 4); add d mid-decode (a mixed, eager step);
        decode 4; finish b; decode 3 again."""
        prompts = {"a": [5, 9, 3, 7, 11], "b": list(range(3, 36)), "c": list(range(40, 49))}
        self.step(prompts, [])
        for _ in range(6):
            self.step({}, ["a", "b", "c"])
        self.step({"d": list(range(60, 80))}, ["a", "b", "c"])
        for _ in range(4):
            self.step({}, ["a", "b", "c", "d"])
        self.finished = ["b"]
        for _ in range(3):
            self.step({}, ["a", "c", "d"])
        return {rid: r["tokens"] for rid, r in self.reqs.items()}


def test_graph_runner_in_model_runner_matches_eager(tiny_llama):
    """Replays (batches of 3 padded to 4, batches of 4) give the eager runner's tokens, with
    the reference attention on both sides and with the CPU attention path as a third."""
    graphs = _runner(tiny_llama, ref_attention=True, graph_sizes=[1, 2, 4, 8])
    eager = _runner(tiny_llama, ref_attention=True)
    plain = _runner(tiny_llama, ref_attention=False)
    got = _Sim(graphs).run()
    assert got == _Sim(eager).run() == _Sim(plain).run()
    # 6 + 4 + 3 uniform decode steps replayed; the prefill and the mixed step ran eagerly.
    assert graphs.cuda_graphs.num_replays == 13
    for (gk, gv), (ek, ev) in zip(graphs.kv_caches, eager.kv_caches, strict=True):
        torch.testing.assert_close(gk, ek, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gv, ev, atol=1e-5, rtol=1e-5)


def test_graph_runner_falls_back_to_eager_above_largest_size(tiny_llama):
    runner = _runner(tiny_llama, ref_attention=True, graph_sizes=[1, 2])
    sim = _Sim(runner)
    sim.step({"a": [4, 5, 6], "b": [7, 8], "c": [9]}, [])
    sim.step({}, ["a", "b", "c"])  # 3 > 2: eager
    assert runner.cuda_graphs.num_replays == 0
    sim.finished = ["c"]
    sim.step({}, ["a", "b"])
    assert runner.cuda_graphs.num_replays == 1


def test_capture_cuda_graphs_off_without_cuda_or_when_eager():
    def fake(device, **kw):
        return types.SimpleNamespace(device=torch.device(device), config=EngineConfig(**kw))

    assert capture_cuda_graphs(fake("cpu")) is None
    assert capture_cuda_graphs(fake("cuda", enforce_eager=True)) is None
    tp2 = fake("cuda", parallel=ParallelConfig(tensor_parallel_size=2))
    assert capture_cuda_graphs(tp2) is None


# ───────────────────────────── GPU kernel dispatch ─────────────────────────────


def test_model_dispatches_norm_and_rotary_to_triton_on_gpu(tiny_llama, monkeypatch):
    """On CUDA tensors RMSNorm and rotary call the Triton wrappers. Here the device check is
    forced and the wrappers are the references (in place, as the rotary kernel is): the
    model must call them for every norm and every layer's q/k, with unchanged results."""
    from vx.gpu.loader import load_model

    model = load_model(tiny_llama, dtype=torch.float32, progress=False)
    prompts = {"x": [3, 5, 7, 9, 11, 13], "y": [21, 22]}
    want = PagedDriver(model).greedy(prompts, 4)
    want_logits = PagedDriver(model).step(prompts)

    calls = {"rms_norm": 0, "rotary": 0}

    def rms_norm(x, weight, eps, residual=None):
        calls["rms_norm"] += 1
        return rms_norm_ref(x, weight, eps, residual)

    def rotary_embedding(positions, q, k, cos, sin):
        calls["rotary"] += 1
        rq, rk = rotary_embedding_ref(positions, q, k, cos, sin)
        q.copy_(rq)
        k.copy_(rk)
        return q, k

    ops = types.SimpleNamespace(rms_norm=rms_norm, rotary_embedding=rotary_embedding)
    monkeypatch.setattr(triton_ops, "for_tensor", lambda x: ops)
    got_logits = PagedDriver(model).step(prompts)
    n_layers = model.num_layers
    assert calls == {"rms_norm": 2 * n_layers + 1, "rotary": n_layers}
    for r in prompts:
        torch.testing.assert_close(got_logits[r], want_logits[r], atol=1e-5, rtol=1e-5)
    assert PagedDriver(model).greedy(prompts, 4) == want


def _spec_runner(path, graph_sizes=None) -> ModelRunner:
    """`_runner` with n-gram speculation (up to 3 drafts a step), the reference attention."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    return _runner(path, ref_attention=True, graph_sizes=graph_sizes, speculative=spec)


def _run_with_drafts(
    runner: ModelRunner, oracle: dict[str, list[int]] | None = None, steps: int = 12
) -> tuple[dict[str, list[int]], int, int]:
    """Prefill two prompts, then `steps` steps; with `oracle` (a run's tokens without drafts) each
    request scores 3 drafts a step (1 + 3 rows): the oracle's next tokens (all accepted) on even
    steps, junk (rejected) on odd ones. Returns the tokens, the verify steps and their largest
    row count."""
    free = list(range(64))[::-1]
    reqs: dict[str, dict] = {}
    prompts = {"a": [5, 9, 3, 7] * 5, "b": [11, 12, 13] * 7}
    drafts: dict[str, list[int]] = {}
    verify_steps = max_rows = 0
    for step_id in range(steps + 1):
        news, cached, sched = [], [], {}
        for rid, prompt in (prompts if step_id == 0 else {}).items():
            news.append(_admit(reqs, free, rid, prompt))
            sched[rid] = len(prompt)
        for rid, r in reqs.items() if step_id else ():
            n = 1 + len(drafts.get(rid, []))
            # blocks past the computed tokens held rejected drafts only: freed (the runner
            # drops them by the same rule)
            keep = -(-r["computed"] // BS)
            free += r["blocks"][keep:]
            del r["blocks"][keep:]
            fresh = []
            while r["computed"] + n > len(r["blocks"]) * BS:
                fresh.append(free.pop())
                r["blocks"].append(fresh[-1])
            cached.append((rid, fresh, r["computed"]))
            sched[rid] = n
        spec = {rid: d for rid, d in drafts.items() if d and step_id}
        if spec:
            verify_steps += 1
            max_rows = max(max_rows, sum(sched.values()))
        so = _step(step_id, news, cached, sched, [], spec)
        out = runner.execute(so)
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            r = reqs[rid]
            # a prompt step computes the prompt; a verify step the emitted tokens' inputs
            r["computed"] += sched[rid] if step_id == 0 else len(toks)
            r["tokens"] += toks
        drafts = {}
        for rid, r in reqs.items():
            if oracle is not None:
                n = len(r["tokens"])
                drafts[rid] = oracle[rid][n : n + 3] if step_id % 2 else [1, 2, 3]
    return {rid: r["tokens"] for rid, r in reqs.items()}, verify_steps, max_rows


def test_verify_steps_replay_graphs_of_their_rows(tiny_llama):
    """A step that scores drafts is a uniform decode batch of its 1 + k rows a request (each
    row a decode row of the attention), so it replays the graph of its padded row count: the
    capture sizes hold the verify rows, and the tokens are the eager runner's."""
    graphs = _spec_runner(tiny_llama, graph_sizes=[1, 2, 4, 8, 16])
    eager = _spec_runner(tiny_llama)
    oracle, _, _ = _run_with_drafts(_spec_runner(tiny_llama), steps=40)
    got, verify_steps, max_rows = _run_with_drafts(graphs, oracle)
    want, _, _ = _run_with_drafts(eager, oracle)
    assert got == want
    assert all(oracle[rid][: len(t)] == t for rid, t in got.items())
    assert verify_steps == 12 and max_rows == 8  # two requests of 1 + 3 rows
    # every step after the prefill was decode rows only: all 12 replayed
    assert graphs.cuda_graphs.num_replays == 12
