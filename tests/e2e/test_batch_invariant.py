"""Batch-invariant inference (`--batch-invariant`), on the real engine (`vx.LLM`, bf16).

A request's token ids and logprobs must be bit-identical whatever shares its steps: no other
request or up to 63 of random lengths, a cold prefix cache or any number of its blocks cached
(by itself or by other requests sharing part of its prompt), any chunk budget, async
scheduling on or off, preemption. Seeded sampling (temperature 1, top-p 0.9, n = 2) and greedy,
both with logprobs, in bf16 (the default) and fp32. The mode is implemented where one GEMM takes every row count: bf16 on CPUs with
AMX (vx's AMX GEMM), AVX512-BF16 (its VNNI GEMM) or AVX2 (its panel GEMM); elsewhere the engine refuses it at start-up, with the reason (tested
everywhere). Preemption too: a recomputed output token is a decode row again (the scheduler
schedules one a step past the prompt), so its K/V has the bits it had.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.models import SERVED, make_tiny_model  # noqa: E402
from vx import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
logger = logging.getLogger(__name__)

NEW_TOKENS = 24


def _invariant_here() -> bool:
    """Whether this CPU has a GEMM for every row count (`invariant_method` takes a weight)."""
    from types import SimpleNamespace

    from vx.gpu.layers.linear_method import BatchInvariantError, invariant_method

    layer = SimpleNamespace(weight=torch.zeros(16, 32, dtype=torch.bfloat16), quantization=None)
    try:
        invariant_method(layer)
    except BatchInvariantError:
        return False
    return True


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # vocab 512: the LM head's rows a multiple of 16, as the VNNI GEMM takes them
    return make_tiny_model(
        tmp_path_factory.mktemp("invariant"), vocab_size=512, max_position_embeddings=2048,
        **SERVED,
    )  # fmt: skip


def _targets(rng: random.Random) -> list[list[int]]:
    # 1 token, under a block, a few blocks and a ragged tail, the 2nd sharing the 3rd's head
    long = [rng.randrange(3, 500) for _ in range(75)]
    return [[7], long[:13], long, [rng.randrange(3, 500) for _ in range(40)]]


PARAMS = [
    SamplingParams.create(temperature=1.0, top_p=0.9, n=2, seed=7, logprobs=3,
                          max_tokens=NEW_TOKENS, ignore_eos=True),
    SamplingParams.create(temperature=0.0, logprobs=3, max_tokens=NEW_TOKENS, ignore_eos=True),
]  # fmt: skip


def _outputs(results: list[Any], count: int) -> list[Any]:
    return [[(c.token_ids, c.logprobs) for c in r.outputs] for r in results[:count]]


def _run(llm: LLM, targets: list[list[int]], params: SamplingParams, others: int,
         rng: random.Random, last: bool = False) -> list[Any]:  # fmt: skip
    """The targets' outputs, generated beside `others` random requests (some of them sharing
    a target's prompt head, so its cache state varies too); with `last`, the targets are
    admitted last, so they are the first a short pool preempts."""
    prompts, plist = list(targets), [params] * len(targets)
    for _ in range(others):
        if rng.random() < 0.3:
            t = rng.choice(targets)
            head = t[: rng.randint(1, len(t))]
            prompt = head + [rng.randrange(3, 500) for _ in range(rng.randint(0, 40))]
        else:
            prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 300))]
        prompts.append(prompt)
        plist.append(
            SamplingParams.create(temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(1 << 30),
                                  max_tokens=rng.randint(1, 40), ignore_eos=True,
                                  logprobs=rng.choice([None, 2]))
        )  # fmt: skip
    order = list(range(len(prompts)))
    rng.shuffle(order)  # the targets anywhere in the batch
    if last:
        order = [i for i in order if i >= len(targets)] + list(range(len(targets)))
    results = llm.generate([prompts[i] for i in order], [plist[i] for i in order],
                           use_tqdm=False)  # fmt: skip
    back = {i: r for i, r in zip(order, results, strict=True)}
    return _outputs([back[i] for i in range(len(targets))], len(targets))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_outputs_do_not_depend_on_batch_cache_chunking_or_scheduling(model: str, dtype: str) -> None:
    if not _invariant_here():
        pytest.skip("batch-invariant mode is implemented for bf16 on AMX, AVX512-BF16 or AVX2")
    rng = random.Random(0)
    targets = _targets(rng)
    reference: list[Any] | None = None
    runs = 0
    for kwargs in (
        {"max_num_batched_tokens": 2048},
        {"max_num_batched_tokens": 16},
        {"max_num_batched_tokens": 64, "async_scheduling": False},
        # a pool of 640 tokens: the crowds preempt the targets, which recompute their outputs
        {"max_num_batched_tokens": 256, "num_blocks": 40},
    ):
        preempting = "num_blocks" in kwargs
        with LLM(model, dtype=dtype, batch_invariant=True, num_threads=1, **kwargs) as llm:
            for params in PARAMS:
                # cold and alone (first run), then cached, then beside 1, 7 and 63 others
                for others in (0, 0, 1, 7, 63):
                    got = [_run(llm, [t], params, others, rng, preempting)[0] for t in targets]
                    key = (params.temperature, tuple(map(len, targets)))
                    if reference is None:
                        reference = {}  # type: ignore[assignment]
                    want = reference.setdefault(key, got)  # type: ignore[union-attr]
                    assert got == want, (kwargs, params.temperature, others)
                    runs += 1
                # all targets in one batch, with others
                got = _run(llm, targets, params, 20, rng)
                want = reference[(params.temperature, tuple(map(len, targets)))]  # type: ignore[index]
                assert got == want, (kwargs, params.temperature, "together")
                runs += 1
            if preempting:
                assert llm.call_utility("get_stats")["num_preempted_total"] > 0
    seeded = reference[(1.0, tuple(map(len, targets)))]  # type: ignore[index]
    assert all(len({tuple(c[0]) for c in choices}) == 2 for choices in seeded)  # n=2 differ
    logger.info("batch invariant: %d runs x %d requests identical", runs, len(targets))


def test_refused_where_no_gemm_takes_every_row(model: str, tmp_path) -> None:
    """Weight-only quantization has no row-invariant GEMM (its kernels take a few rows): the
    start-up fails and says so; so does a CPU without a GEMM for every row count, and a family
    whose blocks run torch's kernels (experts here)."""
    from vx.gpu.layers.linear_method import BatchInvariantError

    kinds = [{"quantization": "int8"}] + ([] if _invariant_here() else [{}])
    for kw in kinds:
        with pytest.raises(Exception, match="--batch-invariant is implemented for bf16") as e:
            LLM(model, batch_invariant=True, num_threads=1, **kw)
        assert e.type is not BatchInvariantError or "not for" in str(e.value)
    # its router's 8 rows, or its blocks: refused either way, with what is not covered
    moe = make_tiny_model(tmp_path, "mixtral", **SERVED)
    with pytest.raises(Exception, match="--batch-invariant is implemented for .*; not for"):
        LLM(moe, batch_invariant=True, num_threads=1)


def test_served_outputs_are_invariant_through_the_openai_client(model: str) -> None:
    """`vx serve --batch-invariant`, the official client: the same seeded (n = 2) and greedy
    completions, with logprobs, cold, after a prefix hit, streamed, and beside 63 concurrent
    random requests, give the same tokens and logprobs; choice i of n = 4 is seed + i alone;
    `vx.LLM` gives the same; /version and the banner say it is on."""
    if not _invariant_here():
        pytest.skip("batch-invariant mode is implemented for bf16 on AMX, AVX512-BF16 or AVX2")
    import concurrent.futures

    import httpx
    import openai

    from tests.e2e.server import VxServer

    rng = random.Random(1)
    # ids of the tokenizer's (384; the model's rows are padded to 512)
    prompt = [rng.randrange(3, 380) for _ in range(65)]  # a hit leaves one token to compute
    bodies = [
        {"temperature": 1.0, "top_p": 0.9, "n": 2, "seed": 7},
        {"temperature": 0.0},
    ]
    served: list[Any] = [None]  # the seeded n = 2 answer
    with VxServer(model, "--batch-invariant", "--served-model-name", "tiny") as srv:
        assert httpx.get(srv.url + "/version", timeout=10).json()["batch_invariant"] is True
        assert "batch invariant on" in srv.full_log()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)

        def ask(body: dict[str, Any], stream: bool = False) -> list[Any]:
            kw = dict(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, logprobs=3,
                      extra_body={"ignore_eos": True}, **body)  # fmt: skip
            if not stream:
                r = client.completions.create(**kw)
                return [(c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs)
                        for c in sorted(r.choices, key=lambda c: c.index)]  # fmt: skip
            parts: dict[int, list[Any]] = {}
            for chunk in client.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    p = parts.setdefault(c.index, ["", [], []])
                    p[0] += c.text
                    if c.logprobs is not None:
                        p[1] += c.logprobs.token_logprobs
                        p[2] += c.logprobs.top_logprobs
            return [tuple(parts[i]) for i in sorted(parts)]

        def noise(i: int) -> None:
            r = random.Random(100 + i)
            client.completions.create(
                model="tiny", prompt=[r.randrange(3, 380) for _ in range(r.randint(1, 300))],
                max_tokens=r.randint(1, 40), temperature=1.0, seed=i,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        for body in bodies:
            cold = ask(body)
            assert ask(body) == cold  # prefix hit
            assert ask(body, stream=True) == cold
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                crowd = [pool.submit(noise, i) for i in range(63)]
                beside = pool.submit(ask, body)
                for f in crowd:
                    f.result()
                assert beside.result() == cold
            if body.get("n") == 2:
                assert cold[0][0] != cold[1][0]  # choice 1 samples with seed 8
                served[0] = cold
        # choice i of n = 4 is the request of seed 7 + i alone (`SamplingParams.for_choice`)
        four = ask({"temperature": 1.0, "top_p": 0.9, "n": 4, "seed": 7})
        assert four[:2] == served[0]
        for i in range(4):
            assert ask({"temperature": 1.0, "top_p": 0.9, "seed": 7 + i}) == [four[i]], i
    # vx.LLM gives the served tokens: the same text and chosen tokens' logprobs
    params = SamplingParams.create(temperature=1.0, top_p=0.9, n=2, seed=7, logprobs=3,
                                   max_tokens=NEW_TOKENS, ignore_eos=True)  # fmt: skip
    with LLM(model, batch_invariant=True, num_threads=1) as llm:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    offline = [(c.text, [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
               for c in out.outputs]  # fmt: skip
    assert offline == [(text, lps) for text, lps, _ in served[0]]


# The property test's engines: chunk budgets, async scheduling on and off, and a pool short
# enough that a crowd preempts the target (it then recomputes its outputs).
_ENGINES = {
    "budget 2048": {"max_num_batched_tokens": 2048},
    "budget 16": {"max_num_batched_tokens": 16},
    "budget 64, sync": {"max_num_batched_tokens": 64, "async_scheduling": False},
    "budget 256, 640-token pool": {"max_num_batched_tokens": 256, "num_blocks": 40},
}


def test_property_random_batches_cache_states_and_chunk_budgets(model: str) -> None:
    """Hypothesis drives the real engine (bf16): a random prompt, seeded or greedy with
    logprobs, on a random engine (chunk budget, async on or off, a pool that preempts),
    from a random cache state (cold, its whole prompt cached, or a random head of it cached by
    another request), admitted at a random place among 0-63 random requests. Its token ids and
    logprobs must equal the request's run alone on a cold cache."""
    if not _invariant_here():
        pytest.skip("batch-invariant mode is implemented for bf16 on AMX, AVX512-BF16 or AVX2")
    from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

    engines: dict[str, LLM] = {}
    alone: dict[Any, Any] = {}
    examples = [0]
    seen: set[tuple[str, str]] = set()

    def engine(name: str) -> LLM:
        if name not in engines:
            engines[name] = LLM(model, batch_invariant=True, num_threads=1, **_ENGINES[name])
        return engines[name]

    def generate(llm: LLM, prompts: list[list[int]], plist: list[SamplingParams]) -> list[Any]:
        return _outputs(llm.generate(prompts, plist, use_tqdm=False), len(prompts))

    other = st.tuples(
        st.integers(1, 300),  # prompt length
        st.booleans(),  # whether it starts with a head of the target's prompt
        st.sampled_from([0.0, 1.0]),
        st.integers(1, 40),  # max_tokens
        st.integers(0, 1 << 30),  # its seed, and its prompt's ids
    )

    crowd = [(300 - i, i % 3 == 0, float(i % 2), 40, i) for i in range(63)]

    @settings(max_examples=24, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    # the corners, whatever the search draws: a crowd that preempts the target, and 63 others
    # beside a cached head at the smallest budget
    @example(prompt=list(range(3, 140)), sampled=True, seed=5, name="budget 256, 640-token pool",
             cache="a head", head=0.5, others=crowd, place=1.0)  # fmt: skip
    @example(prompt=list(range(9, 90)), sampled=False, seed=0, name="budget 16",
             cache="a head", head=0.3, others=crowd, place=0.5)  # fmt: skip
    @given(
        prompt=st.lists(st.integers(3, 499), min_size=1, max_size=150),
        sampled=st.booleans(),
        seed=st.integers(0, 1 << 20),
        name=st.sampled_from(sorted(_ENGINES)),
        cache=st.sampled_from(["cold", "whole prompt", "a head"]),
        head=st.floats(0.0, 1.0),
        others=st.lists(other, max_size=63),
        place=st.floats(0.0, 1.0),
    )
    def check(prompt: list[int], sampled: bool, seed: int, name: str, cache: str, head: float,
              others: list[Any], place: float) -> None:  # fmt: skip
        params = (
            SamplingParams.create(temperature=1.0, top_p=0.9, n=2, seed=seed, logprobs=3,
                                  max_tokens=NEW_TOKENS, ignore_eos=True)
            if sampled else PARAMS[1]
        )  # fmt: skip
        key = (tuple(prompt), sampled and seed)
        if key not in alone:
            ref = engine("budget 2048")
            assert ref.call_utility("reset_prefix_cache")["ok"]
            alone[key] = generate(ref, [prompt], [params])[0]
        llm = engine(name)
        assert llm.call_utility("reset_prefix_cache")["ok"]
        cut = max(1, round(head * len(prompt)))
        if cache == "whole prompt":
            generate(llm, [prompt], [params])
        elif cache == "a head":
            generate(llm, [prompt[:cut] + [3, 4]], [PARAMS[1]])
        prompts, plist = [], []
        for length, shares, temperature, max_tokens, s in others:
            r = random.Random(s)
            body = [r.randrange(3, 500) for _ in range(length)]
            prompts.append(prompt[:cut] + body[: length // 4] if shares else body)
            plist.append(SamplingParams.create(temperature=temperature, seed=s,
                                               max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
        at = round(place * len(prompts))
        prompts.insert(at, prompt)
        plist.insert(at, params)
        got = generate(llm, prompts, plist)[at]
        assert got == alone[key], (name, cache, len(others), at)
        examples[0] += 1
        seen.add((name, cache))

    preempted = 0
    try:
        check()
        if "budget 256, 640-token pool" in engines:
            preempted = engines["budget 256, 640-token pool"].call_utility("get_stats")[
                "num_preempted_total"]  # fmt: skip
    finally:
        for llm in engines.values():
            llm.close()
    assert examples[0] >= 26
    logger.info("batch invariant property: %d random examples identical to the request alone, "
                "over %d (engine, cache state) pairs; %s preemptions", examples[0], len(seen),
                preempted)  # fmt: skip
