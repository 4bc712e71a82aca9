"""InputBatch diff application, and the ModelRunner end to end on a tiny random Llama.

The runner is driven by hand-made SchedulerOutputs (a small scheduler stand-in, `Sim`) and its
greedy tokens must equal HF transformers' in fp32: chunked prompts (7, 16, 33 tokens a chunk),
several requests in one batch, prefix-cache hits (shared first blocks), and preemption.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from tests.models import make_tiny_model
from vx.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vx.gpu.input_batch import InputBatch
from vx.gpu.model_runner import ModelRunner
from vx.messages import CachedRequestData, NewRequestData, SchedulerOutput
from vx.sampling_params import SamplingParams

BS = 16
GREEDY = SamplingParams.create(temperature=0.0, max_tokens=64)


def _new(req_id, prompt, blocks, computed=0, outputs=(), params=GREEDY, eos=None):
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        block_ids=list(blocks),
        num_computed_tokens=computed,
        output_token_ids=list(outputs),
        eos_token_id=eos,
    )


def _so(step_id, new=(), cached=(), scheduled=None, finished=(), preempted=()):
    scheduled = scheduled or {}
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[c[0] for c in cached],
            new_block_ids=[list(c[1]) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=list(finished),
        preempted_req_ids=list(preempted),
    )


# ───────────────────────────── InputBatch ─────────────────────────────


def _check_dense(batch: InputBatch) -> None:
    assert sorted(batch.req_id_to_index.values()) == list(range(batch.num_reqs))
    for i, r in enumerate(batch.req_ids):
        assert batch.req_id_to_index[r] == i


def test_input_batch_add_update_remove_compact():
    b = InputBatch(max_num_reqs=4, max_model_len=64, max_num_blocks_per_req=4)
    b.apply(_so(0, new=[_new("a", [1, 2, 3], [5]), _new("b", [4, 5], [6]), _new("c", [7], [7])]))
    assert b.req_ids == ["a", "b", "c"]
    assert b.num_tokens[:3].tolist() == [3, 2, 1]
    assert b.token_ids[1, :2].tolist() == [4, 5]
    # Cached update: new blocks appended, computed count set.
    b.apply(_so(1, cached=[("a", [9], 3), ("c", [], 1)]))
    a = b.req_id_to_index["a"]
    assert b.block_table[a, :2].tolist() == [5, 9] and b.num_blocks[a] == 2
    assert b.num_computed_tokens[a] == 3
    b.append_tokens(np.array([a, b.req_id_to_index["c"]]), np.array([42, 43]))
    assert b.output_token_ids(a).tolist() == [42] and b.num_tokens[a] == 4
    # Removing "a" moves the last row ("c") into row 0: no rebuild, rows stay dense.
    b.apply(_so(2, finished=["a"]))
    assert b.req_ids == ["c", "b"]
    c = b.req_id_to_index["c"]
    assert c == 0 and b.token_ids[c, :2].tolist() == [7, 43] and b.num_tokens[c] == 2
    assert b.block_table[c, :1].tolist() == [7] and b.num_blocks[c] == 1
    assert b.prompt_token_ids(c).tolist() == [7]
    _check_dense(b)
    assert not b.remove("zzz")
    with pytest.raises(KeyError):
        b.apply(_so(3, cached=[("a", [], 0)]))


def test_input_batch_preempt_and_resume():
    b = InputBatch(max_num_reqs=3, max_model_len=64, max_num_blocks_per_req=4)
    b.apply(_so(0, new=[_new("a", [1, 2, 3], [0]), _new("b", [4], [1])]))
    b.append_tokens(np.array([0, 1]), np.array([10, 11]))
    b.apply(_so(1, preempted=["a"]))
    assert b.req_ids == ["b"] and "a" not in b
    # Resumed: prompt + the outputs so far, recomputed from scratch in new blocks.
    b.apply(_so(2, new=[_new("a", [1, 2, 3], [2, 3], outputs=[10])]))
    a = b.req_id_to_index["a"]
    assert b.token_ids[a, :4].tolist() == [1, 2, 3, 10]
    assert b.num_prompt_tokens[a] == 3 and b.num_tokens[a] == 4
    assert b.output_token_ids(a).tolist() == [10]
    assert b.block_table[a, :2].tolist() == [2, 3]
    assert b.wants_prompt_logprobs[a] is False
    _check_dense(b)


def test_input_batch_limits():
    full = InputBatch(max_num_reqs=1, max_model_len=4, max_num_blocks_per_req=1)
    full.add(_new("f", [1, 2, 3, 4], [0]))
    full.append_tokens(np.array([0]), np.array([5]))  # the token sampled at the last position
    full.append_tokens(np.array([0]), np.array([6]))  # one async step too far: dropped
    assert full.token_ids[0, :5].tolist() == [1, 2, 3, 4, 5] and full.num_tokens[0] == 5
    b = InputBatch(max_num_reqs=1, max_model_len=8, max_num_blocks_per_req=1)
    with pytest.raises(ValueError, match="max_model_len"):
        b.add(_new("x", list(range(9)), [0]))
    b.add(_new("a", [1], [0]))
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        b.add(_new("b", [1], [1]))
    with pytest.raises(ValueError, match="blocks"):
        b.apply(_so(1, cached=[("a", [3], 1)]))


# ───────────────────────────── ModelRunner ─────────────────────────────


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("runner"), "llama")


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def make_runner(path, num_blocks=96, max_num_seqs=8, dtype="float32"):
    config = EngineConfig(
        model=ModelConfig(path=path, dtype=dtype, max_model_len=256),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256),
        cache=CacheConfig(num_blocks_override=num_blocks),
        num_threads=None,
    )
    config.validate()
    runner = ModelRunner(config, device="cpu")
    runner.load_model()
    n, _ = runner.determine_num_blocks()
    assert n == num_blocks
    runner.initialize_kv_cache(n)
    return runner


@torch.no_grad()
def hf_greedy(hf, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


class Sim:
    """A scheduler stand-in: block allocation from a shuffled pool, chunked prefill, decode."""

    def __init__(self, runner, num_blocks=96, seed=0):
        self.runner = runner
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, dict] = {}
        self.step_id = 0
        self.finished: list[str] = []
        self.preempted: list[str] = []

    def add(self, req_id, prompt, params=GREEDY, computed=0, blocks=(), outputs=(), eos=None):
        self.reqs[req_id] = dict(
            prompt=list(prompt), params=params, computed=computed, blocks=list(blocks),
            outputs=list(outputs), sent=False, resumed_outputs=list(outputs), eos=eos,
        )  # fmt: skip

    def preempt(self, req_id):
        r = self.reqs[req_id]
        self.free += r["blocks"]
        r.update(blocks=[], computed=0, sent=False, resumed_outputs=list(r["outputs"]))
        self.preempted.append(req_id)

    def step(self, plan: dict[str, int]):
        new, cached = [], []
        for rid, n in plan.items():
            r = self.reqs[rid]
            need = math.ceil((r["computed"] + n) / BS) - len(r["blocks"])
            fresh = [self.free.pop() for _ in range(max(need, 0))]
            r["blocks"] += fresh
            if r["sent"]:
                cached.append((rid, fresh, r["computed"]))
            else:
                new.append(
                    _new(
                        rid,
                        r["prompt"],
                        r["blocks"],
                        r["computed"],
                        r["resumed_outputs"],
                        r["params"],
                        r["eos"],
                    )
                )
                r["sent"] = True
        so = _so(self.step_id, new, cached, plan, self.finished, self.preempted)
        self.finished, self.preempted = [], []
        self.step_id += 1
        out = self.runner.execute(so)
        assert sorted(out.req_ids) == sorted(plan)
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            r = self.reqs[rid]
            r["computed"] += plan[rid]
            known = len(r["prompt"]) + len(r["outputs"])
            assert (len(toks) == 1) == (r["computed"] == known), (rid, toks)
            r["outputs"] += toks
        return out

    def run(self, req_ids, chunk, max_new):
        """Step all `req_ids` until each has `max_new` outputs; chunk = prefill budget each."""
        active = list(req_ids)
        while active:
            plan = {}
            for rid in active:
                r = self.reqs[rid]
                known = len(r["prompt"]) + len(r["outputs"])
                plan[rid] = min(chunk, known - r["computed"])
            self.step(plan)
            for rid in list(active):
                if len(self.reqs[rid]["outputs"]) >= max_new:
                    active.remove(rid)
                    self.finished.append(rid)
        return {rid: self.reqs[rid]["outputs"][:max_new] for rid in req_ids}


PROMPT = [(i * 37 + 11) % 300 + 3 for i in range(50)]


@pytest.mark.parametrize("chunk", [7, 16, 33, 256])
def test_runner_greedy_matches_hf_chunked(tiny_llama, hf, chunk):
    runner = make_runner(tiny_llama)
    sim = Sim(runner)
    sim.add("r", PROMPT)
    got = sim.run(["r"], chunk, 12)["r"]
    assert got == hf_greedy(hf, PROMPT, 12)


def test_runner_batch_of_requests(tiny_llama, hf):
    prompts = {
        "a": PROMPT[:23],
        "b": PROMPT[5:45],
        "c": [7],
        "d": PROMPT[::-1][:17],
    }
    runner = make_runner(tiny_llama)
    sim = Sim(runner, seed=1)
    for rid, p in prompts.items():
        sim.add(rid, p)
    got = sim.run(list(prompts), 16, 9)
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(hf, p, 9), rid


def test_runner_staggered_arrivals_mix_prefill_and_decode(tiny_llama, hf):
    runner = make_runner(tiny_llama)
    sim = Sim(runner, seed=2)
    sim.add("a", PROMPT[:20])
    sim.step({"a": 20})
    sim.step({"a": 1})
    # "b" prefills in chunks while "a" decodes in the same steps.
    sim.add("b", PROMPT[10:47])
    out = sim.step({"a": 1, "b": 16})
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids[1] == []  # b is mid-prefill
    sim.step({"a": 1, "b": 16})
    sim.step({"a": 1, "b": 5})
    for _ in range(4):
        sim.step({"a": 1, "b": 1})
    assert sim.reqs["a"]["outputs"] == hf_greedy(hf, PROMPT[:20], 9)
    assert sim.reqs["b"]["outputs"] == hf_greedy(hf, PROMPT[10:47], 5)


@pytest.mark.parametrize("num_cached", [16, 32])
def test_runner_prefix_cache_hit(tiny_llama, hf, num_cached):
    """A second request starts after the first one's cached blocks (shared block ids)."""
    runner = make_runner(tiny_llama)
    sim = Sim(runner, seed=3)
    sim.add("first", PROMPT[:40])
    sim.run(["first"], 40, 3)
    shared = sim.reqs["first"]["blocks"][: num_cached // BS]
    second = PROMPT[:num_cached] + [9, 8, 7, 6, 5]
    sim.add("second", second, computed=num_cached, blocks=shared)
    got = sim.run(["second"], 7, 6)["second"]
    assert got == hf_greedy(hf, second, 6)


def test_runner_preemption_and_resume(tiny_llama, hf):
    runner = make_runner(tiny_llama)
    sim = Sim(runner, seed=4)
    sim.add("a", PROMPT[:30])
    sim.add("b", PROMPT[20:35])
    for _ in range(2):
        sim.step({"a": min(16, 30 + len(sim.reqs["a"]["outputs"]) - sim.reqs["a"]["computed"]), "b": 15 if not sim.reqs["b"]["computed"] else 1})  # fmt: skip
    for _ in range(3):
        sim.step({"a": 1, "b": 1})
    sim.preempt("a")
    sim.step({"b": 1})
    # "a" comes back with its outputs so far and recomputes everything, in 2 chunks.
    known = 30 + len(sim.reqs["a"]["outputs"])
    sim.step({"a": 20, "b": 1})
    sim.step({"a": known - 20, "b": 1})
    sim.step({"a": 1})
    assert sim.reqs["a"]["outputs"] == hf_greedy(hf, PROMPT[:30], len(sim.reqs["a"]["outputs"]))
    assert sim.reqs["b"]["outputs"] == hf_greedy(hf, PROMPT[20:35], len(sim.reqs["b"]["outputs"]))


def test_runner_logprobs_and_prompt_logprobs(tiny_llama, hf):
    runner = make_runner(tiny_llama)
    sim = Sim(runner, seed=5)
    params = SamplingParams.create(temperature=0.0, logprobs=3, prompt_logprobs=2)
    prompt = PROMPT[:21]
    sim.add("a", prompt, params=params)
    sim.add("g", PROMPT[:5])  # a plain greedy neighbour: no logprobs
    out1 = sim.step({"a": 13, "g": 5})
    out2 = sim.step({"a": 8, "g": 1})
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    # Prompt logprobs: chunk 1 covers tokens 1..13, chunk 2 tokens 14..20.
    pl1, pl2 = out1.prompt_logprobs["a"], out2.prompt_logprobs["a"]
    assert "g" not in out1.prompt_logprobs
    rows = pl1.token_ids + pl2.token_ids
    lps = pl1.logprobs + pl2.logprobs
    assert len(rows) == len(prompt) - 1
    for p, (ids, lp) in enumerate(zip(rows, lps, strict=True)):
        assert len(ids) == 3 and ids[0] == prompt[p + 1]
        assert lp[0] == pytest.approx(float(ref[p, prompt[p + 1]]), abs=1e-4)
        assert ids[1] == int(ref[p].argmax())
    # Sample logprobs: 1 + 3 entries, the sampled token first; none for the neighbour.
    assert out1.sampled_token_ids[out1.req_ids.index("a")] == []
    ia, ig = out2.req_ids.index("a"), out2.req_ids.index("g")
    lp = out2.logprobs[ia]
    assert out2.logprobs[ig] is None
    tok = out2.sampled_token_ids[ia][0]
    assert lp.token_ids[0][0] == tok and len(lp.token_ids[0]) == 4 and lp.ranks == [1]
    assert lp.logprobs[0][0] == pytest.approx(float(ref[-1, tok]), abs=1e-4)
    assert lp.token_ids[0][1] == tok  # greedy: the top-1 is the sampled token


def test_runner_empty_step_and_errors(tiny_llama):
    runner = make_runner(tiny_llama)
    out = runner.execute(_so(0))
    assert out.req_ids == [] and out.sampled_token_ids == []
    runner.execute(_so(1, new=[_new("a", [1, 2, 3], [0])], scheduled={"a": 3}))
    with pytest.raises(ValueError, match="past its known tokens"):
        runner.execute(_so(2, cached=[("a", [], 3)], scheduled={"a": 2}))


def test_runner_cpu_kv_sizing_and_profile(tiny_llama):
    config = EngineConfig(
        model=ModelConfig(path=tiny_llama, dtype="float32", max_model_len=128),
        cache=CacheConfig(kv_cache_memory_bytes=10**6),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=300),
    )
    runner = ModelRunner(config)
    runner.load_model()
    m = runner.model
    per_block = 2 * m.num_layers * m.num_kv_heads * m.head_dim * BS * 4
    n, nbytes = runner.determine_num_blocks()
    assert n == 10**6 // per_block and nbytes == n * per_block
    assert runner.profile_run() == 0  # runs (3 sequences, 128 + 128 + 44 tokens) on CPU


def test_runner_bf16_close_to_fp32(tiny_llama):
    """bf16 runs the same path; its greedy tokens mostly agree with fp32 on a tiny model."""
    outs = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(tiny_llama, dtype=dtype)
        assert runner.kv_caches[0][0].dtype == getattr(torch, dtype)
        sim = Sim(runner)
        sim.add("r", PROMPT)
        outs[dtype] = sim.run(["r"], 16, 8)["r"]
    agree = sum(a == b for a, b in zip(outs["float32"], outs["bfloat16"], strict=True))
    assert agree >= 4


def test_runner_greedy_ids_from_the_lm_head_equal_the_logits_path(tiny_llama, monkeypatch):
    """Plain greedy batches take their tokens from the LM head's argmax kernel (CPU bf16 on
    AMX) without forming the logits: the same tokens as the logits path, step by step; a
    batch with a logprobs request takes the logits path."""
    outs, calls = {}, []
    for fused in (True, False):
        runner = make_runner(tiny_llama, dtype="bfloat16")
        model = runner._model
        real = model.greedy_ids
        if fused:
            monkeypatch.setattr(
                model, "greedy_ids", lambda h, real=real: calls.append(len(h)) or real(h)
            )
        else:
            monkeypatch.setattr(model, "greedy_ids", lambda h: None)
        sim = Sim(runner)
        names = [f"r{i}" for i in range(5)]
        for i, name in enumerate(names):
            sim.add(name, PROMPT[: 6 + i])
        sim.add("lp", PROMPT[:9], params=SamplingParams.create(temperature=0.0, logprobs=2))
        outs[fused] = list(sim.run(names, 12, 8).values())
        if fused:
            n = len(calls)
            lp = sim.run(["lp"], 12, 4)["lp"]
            assert len(lp) == 4 and len(calls) == n  # logprobs: the logits path
    assert outs[True] == outs[False]
    if real(torch.zeros(5, model.lm_head.weight.shape[1], dtype=torch.bfloat16)) is None:
        pytest.skip("no AMX LM head kernel here: both runs took the logits path")
    assert calls and max(calls) == 5


def test_runner_greedy_ids_under_min_tokens_equal_the_sampler(tiny_llama, monkeypatch):
    """Greedy rows short of min_tokens take the LM head's argmax too, and where it is EOS or
    a stop id their logits are formed and masked: the full sampler's tokens, step by step,
    with the masked ids absent until min_tokens is reached."""
    base = make_runner(tiny_llama, dtype="bfloat16")
    sim = Sim(base)
    for i in range(3):
        sim.add(f"r{i}", PROMPT[: 7 + i])
    plain = sim.run(["r0", "r1", "r2"], 16, 10)
    eos, stop = plain["r0"][2], plain["r1"][1]  # tokens the unmasked argmax picks early on
    params = SamplingParams.create(temperature=0.0, min_tokens=8, stop_token_ids=[stop])
    outs, calls, masked_rows = {}, [], []
    for fast in (True, False):
        runner = make_runner(tiny_llama, dtype="bfloat16")
        model = runner._model
        real_ids, real_logits = model.greedy_ids, model.compute_logits
        if fast:
            monkeypatch.setattr(
                model, "greedy_ids", lambda h, real=real_ids: calls.append(len(h)) or real(h)
            )
            monkeypatch.setattr(
                model,
                "compute_logits",
                lambda h, real=real_logits: masked_rows.append(len(h)) or real(h),
            )
        else:
            monkeypatch.setattr(model, "greedy_ids", lambda h: None)
        sim = Sim(runner)
        for i in range(3):
            sim.add(f"r{i}", PROMPT[: 7 + i], params=params, eos=eos)
        outs[fast] = sim.run(["r0", "r1", "r2"], 16, 10)
    assert outs[True] == outs[False]
    for toks in outs[True].values():
        assert eos not in toks[:8] and stop not in toks[:8]
    if real_ids(torch.zeros(3, model.lm_head.weight.shape[1], dtype=torch.bfloat16)) is None:
        pytest.skip("no C argmax of the LM head here: both runs took the logits path")
    assert calls and masked_rows  # the fast path ran, and redid the rows it had to


def test_runner_one_greedy_row_takes_the_int8_screen(tiny_llama, monkeypatch):
    """Where the screen is built (AVX2, the LM head widened; AVX512-BF16, the skinny GEMM on
    the plain head) a step with one greedy row takes its token from the int8 screen of the LM
    head (vx.gpu.cpu.screen): the logits path's tokens, step by step; `VX_CPU_SCREEN_HEAD=0`
    leaves it out. (The one-call greedy step takes such steps through the screen in C where
    it is built, tests/gpu/sample/test_greedy_step.py; it is off here.)"""
    from vx.gpu.cpu import widen as cpu_widen
    from vx.gpu.sample import greedy

    monkeypatch.setattr(greedy, "FUSED_STEP", False)
    outs, taken = {}, []
    for on in ("1", "0"):
        monkeypatch.setenv("VX_CPU_SCREEN_HEAD", on)
        monkeypatch.setattr(cpu_widen, "_state", {})
        runner = make_runner(tiny_llama, dtype="bfloat16")
        screen = runner._model.lm_head.screen
        if on == "0":
            assert screen is None
        elif screen is None:
            pytest.skip("no screen kernels in this machine's build")
        else:
            real = screen.argmax
            monkeypatch.setattr(
                screen, "argmax", lambda x, real=real: taken.append(real(x)) or taken[-1]
            )
        sim = Sim(runner)
        sim.add("r", PROMPT[:7])
        outs[on] = sim.run(["r"], 16, 12)["r"]
    assert outs["1"] == outs["0"] and len(outs["1"]) == 12
    assert len(taken) >= 12 and all(t is not None for t in taken)


def test_runner_last_layer_runs_past_attention_on_the_sampled_rows_only(tiny_llama, hf):
    """A step's last layer runs its o_proj and MLP on the rows that sample a token and no
    other (none at all for a step of mid-prompt chunks), every other layer on every row; the
    tokens stay HF's. A request wanting prompt logprobs keeps every row."""
    runner = make_runner(tiny_llama)
    layers = runner._model.model.layers
    rows = {"first": [], "last": []}
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        layer.mlp.register_forward_hook(lambda m, a, out, name=name: rows[name].append(len(a[0])))
    sim = Sim(runner)
    prompts = {"a": PROMPT[:23], "b": PROMPT[5:45], "c": PROMPT[:3]}
    for rid, p in prompts.items():
        sim.add(rid, p)
    active, got = list(prompts), {}
    while active:
        plan = {}
        for rid in active:
            r = sim.reqs[rid]
            plan[rid] = min(8, len(r["prompt"]) + len(r["outputs"]) - r["computed"])
        rows["first"].clear(), rows["last"].clear()
        out = sim.step(plan)
        sampled = sum(1 for t in out.sampled_token_ids if t)
        assert rows["first"] == [sum(plan.values())]
        assert rows["last"] == ([sampled] if sampled else [])
        for rid in list(active):
            if len(sim.reqs[rid]["outputs"]) >= 6:
                active.remove(rid)
                sim.finished.append(rid)
                got[rid] = sim.reqs[rid]["outputs"][:6]
    assert got == {rid: hf_greedy(hf, p, 6) for rid, p in prompts.items()}
    sim.add("lp", PROMPT[:20], params=SamplingParams.create(temperature=0.0, prompt_logprobs=1))
    rows["last"].clear()
    out = sim.step({"lp": 20})
    assert rows["last"] == [20]
    assert out.prompt_logprobs and len(out.prompt_logprobs["lp"].ranks) == 19


def test_runner_poison_leaves_the_fast_paths_for_its_own_steps_only(tiny_llama, monkeypatch):
    """With `VX_TEST_POISON` set, a step without the poisoned seed takes the fused greedy step
    or the LM head's C argmax as it would unset; a step with a poisoned request takes the
    logits path, where that request fails alone (token -1) and its neighbour gets the tokens
    it gets unpoisoned."""
    from vx.fault_injection import ENV
    from vx.messages import SAMPLE_FAILED

    seed = 6662
    poison = SamplingParams.create(temperature=0.0, seed=seed, max_tokens=64)
    runs = {}
    for armed in (False, True):
        if armed:
            monkeypatch.setenv(ENV, f"worker:{seed}")
        else:
            monkeypatch.delenv(ENV, raising=False)
        runner = make_runner(tiny_llama, dtype="bfloat16")
        assert runner.sampling.poison_seed == (seed if armed else None)
        sim = Sim(runner)
        phases = []
        sim.add("alone", PROMPT[:7])  # one row: the fused greedy step where it is built
        out = {"alone": sim.run(["alone"], 16, 6)["alone"]}
        phases.append(dict(runner.sampling.path_steps))
        sim.add("p", PROMPT[:5], params=poison)
        sim.add("ok", PROMPT[:9])
        sim.add("ok2", PROMPT[20:31])  # three rows: two take neither C path on some CPUs
        out |= sim.run(["p", "ok", "ok2"], 16, 5)
        phases.append(dict(runner.sampling.path_steps))
        sim.add("after", PROMPT[3:10])
        out["after"] = sim.run(["after"], 16, 6)["after"]
        phases.append(dict(runner.sampling.path_steps))
        runs[armed] = out, phases
    (plain, plain_phases), (armed_out, armed_phases) = runs[False], runs[True]
    fast = plain_phases[0]["fused"] + plain_phases[0]["argmax"]
    if not fast:
        pytest.skip("no fused step and no C argmax here: every step takes the logits path")
    # Steps without the poisoned request: the same paths as unarmed, the same tokens.
    assert armed_phases[0] == plain_phases[0]
    assert armed_out["alone"] == plain["alone"] and armed_out["after"] == plain["after"]
    # Steps with it: every one on the logits path (the three sample 5 steps together).
    steps = {k: armed_phases[1][k] - armed_phases[0][k] for k in armed_phases[0]}
    assert steps == {"fused": 0, "argmax": 0, "logits": 5}, steps
    plain_steps = {k: plain_phases[1][k] - plain_phases[0][k] for k in plain_phases[0]}
    assert plain_steps["logits"] == 0, plain_steps  # unarmed, the same steps kept the fast paths
    assert armed_out["p"] == [SAMPLE_FAILED] * 5 and plain["p"] != armed_out["p"]
    assert armed_out["ok"] == plain["ok"] and armed_out["ok2"] == plain["ok2"]
    # ... and once it is gone, the fast paths again.
    after = {k: armed_phases[2][k] - armed_phases[1][k] for k in armed_phases[1]}
    assert after == {k: plain_phases[2][k] - plain_phases[1][k] for k in plain_phases[1]}
    assert after["logits"] == 0 and after["fused"] + after["argmax"] == 6
