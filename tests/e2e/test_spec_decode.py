"""Speculative decoding (n-gram drafts, and the default model drafting for itself) through the
real engine on the default model (bf16), with async scheduling (the default) unless said.

With `--batch-invariant` a row's logits do not depend on the rows beside it, so speculation
must give the very tokens and logprobs of the run without it: greedy and seeded, batched, at a
16-token chunk budget, after prefix hits, and under preemption. On the default path with AMX
every row count takes the AMX GEMM too, and on AVX512-BF16 without AMX the VNNI GEMM, so
greedy output is the same there as well (the same cases); on AVX2 CPUs the check is that drafts
are accepted and the output stays the target's (greedy: each emitted token is the argmax the
engine computed). Served: the official client streams the same text as without
speculation, stops at a stop string inside an accepted run, and /metrics counts the drafts.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from vx import LLM, SamplingParams
from vx.config import ModelConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
logger = logging.getLogger(__name__)

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "All that glitters is not gold. The early bird catches the worm. "
)
PROMPTS = [
    "Copy this text exactly:\n" + PASSAGE * 2 + "\nCopy:\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday. Again: Monday,",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
PARAMS = [
    SamplingParams.create(temperature=0.0, max_tokens=48, logprobs=2),
    SamplingParams.create(temperature=0.8, top_p=0.95, seed=11, max_tokens=48, logprobs=1),
    # EOS masked to the end (as `vx bench serve` asks): the C argmax's min_tokens rows
    SamplingParams.create(temperature=0.0, max_tokens=40, min_tokens=40),
]


def _run(llm: LLM) -> list[Any]:
    got = []
    for params in PARAMS:
        for r in llm.generate(PROMPTS, params, use_tqdm=False):
            got.append([(c.token_ids, c.logprobs) for c in r.outputs])
    return got


@pytest.fixture(scope="module")
def invariant_reference() -> list[Any]:
    """`_run`'s results with `--batch-invariant` and no drafts."""
    with LLM(num_threads=2, batch_invariant=True, async_scheduling=False) as llm:
        return _run(llm)


def test_invariant_outputs_are_the_same_with_drafts(invariant_reference: list[Any]) -> None:
    want = invariant_reference
    # async scheduling (the default: draft slots) and without it (drafts sent)
    for kwargs in (
        {},
        {"max_num_batched_tokens": 16, "async_scheduling": False},
        # ~280 tokens in 192 slots: preempts whichever drafts are taken (16 blocks did not
        # on Zen 5, where the drafts let a request end before the pool ran short)
        {"num_blocks": 12, "max_num_seqs": 3},
    ):
        with LLM(num_threads=2, batch_invariant=True, speculative_config=SPEC, **kwargs) as llm:
            assert _run(llm) == want, kwargs
            assert _run(llm) == want, kwargs  # prefix hits
            stats = llm.call_utility("get_stats")
            assert stats["spec_num_accepted_tokens_total"] > 20, stats
            if "num_blocks" in kwargs:
                assert stats["num_preempted_total"] > 0
    rate = stats["spec_num_accepted_tokens_total"] / stats["spec_num_draft_tokens_total"]
    logger.info("drafts accepted: %.0f%% (by position %s)", 100 * rate,
                stats["spec_num_accepted_by_position"])  # fmt: skip


def test_draft_model_equal_to_the_target_accepts_every_greedy_draft(
    invariant_reference: list[Any],
) -> None:
    """The default model drafting for itself (`draft_model`), with `--batch-invariant`: the
    draft's KV follows the target's chunks (a 32-token budget), prefix hits and preemptions,
    its logits are the target's, so every greedy draft holds and the output (greedy, seeded,
    min_tokens) is the run's without drafts."""
    spec = {"method": "draft_model", "model": ModelConfig().model, "num_speculative_tokens": 3}
    with LLM(num_threads=2, batch_invariant=True, speculative_config=spec,
             max_num_batched_tokens=32, num_blocks=12, max_num_seqs=3) as llm:  # fmt: skip
        got = []
        for params in PARAMS:  # the later ones hit the prompts' cached blocks
            for r in llm.generate(PROMPTS, params, use_tqdm=False):
                got.append([(c.token_ids, c.logprobs) for c in r.outputs])
            if params is PARAMS[0]:  # greedy: every draft holds
                stats = llm.call_utility("get_stats")
                assert stats["spec_num_draft_tokens_total"] > 60, stats
                assert stats["spec_num_accepted_tokens_total"] == (
                    stats["spec_num_draft_tokens_total"]
                ), stats
        stats = llm.call_utility("get_stats")
    assert got == invariant_reference
    assert stats["num_preempted_total"] > 0, stats
    logger.info("draft model: %d of %d drafts accepted (by position %s)",
                stats["spec_num_accepted_tokens_total"], stats["spec_num_draft_tokens_total"],
                stats["spec_num_accepted_by_position"])  # fmt: skip


GREEDY = [
    SamplingParams.create(temperature=0.0, max_tokens=48),
    SamplingParams.create(temperature=0.0, max_tokens=40, min_tokens=40),
]


def _greedy(llm: LLM) -> list[Any]:
    return [[c.token_ids for c in r.outputs]
            for params in GREEDY for r in llm.generate(PROMPTS, params, use_tqdm=False)]  # fmt: skip


@pytest.mark.parametrize("isa", ["amx", "avx512_bf16", "avx2"])
def test_default_path_greedy_outputs_are_the_same_with_drafts(isa: str, monkeypatch) -> None:
    """The default bf16 path (no `--batch-invariant`): every row count takes one GEMM, whose
    sums run over k in one order whatever the rows (the AMX GEMM on AMX; without it, on
    AVX512-BF16, the VNNI GEMM, here with ``VX_CPU_ATTENTION_AMX=0`` on an AMX CPU; on AVX2
    only, the panel order: the compact copies' GEMM to 4 rows, the panels past them, here with
    ``VX_CPU_MARCH=x86-64-v3``), and the
    decode attention gives each verify row its own bits, so a scored row's bits are a one-row
    step's, and greedy output with n-gram drafts is the output without them: batched, at a
    16-token chunk budget, after prefix hits, and under preemption."""
    from vx.gpu.cpu import library

    lib = library.load_cpu_kernels()
    if isa == "amx" and (lib is None or not lib.vx_fast_amx(-1)):
        pytest.skip("no AMX here")
    if isa == "avx512_bf16":
        if lib is None or not lib.vx_has_fast_bf16() or not lib.vx_has_gemm_vnni():
            pytest.skip("no AVX512-BF16 here")
        monkeypatch.setenv("VX_CPU_ATTENTION_AMX", "0")  # the Workers' paths: AMX off
    if isa == "avx2":  # the Workers build for x86-64-v3 (AVX2 only), its widened copies
        with open("/proc/cpuinfo") as f:
            if "avx2" not in f.read():
                pytest.skip("no AVX2 here")
        monkeypatch.setenv("VX_CPU_MARCH", "x86-64-v3")
        monkeypatch.setenv("VX_CPU_WIDEN", "1")
    with LLM(num_threads=2, async_scheduling=False) as llm:
        want = _greedy(llm)
    for kwargs in (
        {},
        {"max_num_batched_tokens": 16, "async_scheduling": False},
        {"num_blocks": 12, "max_num_seqs": 3},
    ):
        with LLM(num_threads=2, speculative_config=SPEC, **kwargs) as llm:
            assert _greedy(llm) == want, kwargs
            assert _greedy(llm) == want, kwargs  # prefix hits
            stats = llm.call_utility("get_stats")
            assert stats["spec_num_accepted_tokens_total"] > 20, stats
            if "num_blocks" in kwargs:
                assert stats["num_preempted_total"] > 0, stats


def test_default_path_accepts_drafts_and_emits_the_targets_argmax() -> None:
    params = SamplingParams.create(temperature=0.0, max_tokens=48, logprobs=0)
    with LLM(num_threads=2, speculative_config=SPEC) as llm:
        results = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.call_utility("get_stats")
    assert stats["spec_num_accepted_tokens_total"] > 20, stats
    for r in results:
        c = r.outputs[0]
        assert len(c.token_ids) == 48 and len(c.logprobs) == 48
        # greedy: each emitted token is the top of the distribution it came from
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert lp[tok] == max(lp.values())


def test_served_stream_is_the_same_and_stops_at_a_stop_string() -> None:
    """`vx serve --batch-invariant`, with and without `--speculative-config`: the official
    client's streamed text is the same; a stop string inside a copied run ends the text before
    it (nothing past it is streamed, though drafts ran past it); /metrics counts the drafts."""
    import json

    import httpx
    import openai

    from tests.e2e.server import VxServer

    def ask(srv: VxServer, **kw: Any) -> tuple[str, str | None]:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        text, finish = "", None
        for chunk in client.completions.create(
            model="smollm2-135m", prompt=PROMPTS[0], max_tokens=48, temperature=0, stream=True,
            **kw,
        ):  # fmt: skip
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    answers = []
    for extra in ((), ("--speculative-config", json.dumps(SPEC))):
        with VxServer("smollm2-135m", "--batch-invariant", "--max-model-len", "1024", *extra,
                      startup_timeout_s=500) as srv:  # fmt: skip
            full = ask(srv)
            cut = ask(srv, stop=["in time"])
            metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        answers.append((full, cut))
        if extra:
            drafts = [ln for ln in metrics.splitlines()
                      if ln.startswith("vx:spec_decode_num_draft_tokens_total{")]  # fmt: skip
            assert drafts and float(drafts[0].split()[-1]) > 0, drafts
    assert answers[0] == answers[1]
    (full, _), (cut, finish) = answers[1]
    assert "in time" in full and cut == full[: full.index("in time")] and finish == "stop"


DAYS_SCHEMA = {
    "type": "object",
    "properties": {"days": {"type": "array", "items": {"type": "string"}, "maxItems": 7}},
    "required": ["days"],
    "additionalProperties": False,
}
JSON_PROMPTS = [
    'Answer in JSON. The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, '
    'Saturday and Sunday. As JSON: {"days": ["Monday", "Tuesday", "Wednesday", "Thursday", '
    '"Friday", "Saturday", "Sunday"]}. Again, as JSON:',
    'Repeat this JSON exactly: {"days": ["Sunday", "Saturday", "Friday"]}. JSON:',
]


def test_constrained_requests_draft_within_their_grammar() -> None:
    """A json_schema request drafts (n-gram, then the draft model): each scored position is
    masked by the state its grammar reaches after the drafts before it, and the matcher keeps
    only the emitted tokens, so with `--batch-invariant` the output is valid and the same as
    without drafts; the draft model's own drafts are masked so too."""
    import json

    from vx import StructuredOutputsParams

    so = StructuredOutputsParams(json=DAYS_SCHEMA)
    params = [
        SamplingParams.create(temperature=0.0, max_tokens=64, structured_outputs=so),
        SamplingParams.create(temperature=0.7, seed=5, max_tokens=64, structured_outputs=so),
    ]

    def run(llm: LLM) -> list[Any]:
        return [(c.token_ids, c.text, c.finish_reason) for p in params
                for r in llm.generate(JSON_PROMPTS, p, use_tqdm=False) for c in r.outputs]  # fmt: skip

    with LLM(num_threads=2, batch_invariant=True, async_scheduling=False) as llm:
        want = run(llm)
    with LLM(num_threads=2, batch_invariant=True, speculative_config=SPEC) as llm:
        got = run(llm)
        stats = llm.call_utility("get_stats")
    assert got == want
    assert stats["spec_num_accepted_tokens_total"] > 10, stats
    done = [text for _, text, finish in got if finish == "stop"]
    assert done
    for text in done:
        assert set(json.loads(text)) == {"days"}
    logger.info("constrained: %d of %d drafts accepted", stats["spec_num_accepted_tokens_total"],
                stats["spec_num_draft_tokens_total"])  # fmt: skip
    # The default model drafting for itself: its drafts are masked by the grammar too, so
    # every greedy draft is the target's own masked argmax, and holds, even where the model
    # left alone would write prose (the last prompt).
    spec = {"method": "draft_model", "model": ModelConfig().model, "num_speculative_tokens": 3}
    with LLM(num_threads=2, batch_invariant=True, speculative_config=spec) as llm:
        greedy = [(c.token_ids, c.text, c.finish_reason)
                  for r in llm.generate([*JSON_PROMPTS, "Once upon a time, by the sea,"],
                                        params[0], use_tqdm=False)
                  for c in r.outputs]  # fmt: skip
        stats = llm.call_utility("get_stats")
    assert greedy[: len(JSON_PROMPTS)] == want[: len(JSON_PROMPTS)]
    assert stats["spec_num_draft_tokens_total"] > 20, stats
    assert stats["spec_num_accepted_tokens_total"] == stats["spec_num_draft_tokens_total"], stats
