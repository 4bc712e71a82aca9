"""Scheduler: the one rule, budgets, prefix hits, preemption, stops, aborts, the diff protocol."""

from __future__ import annotations

import msgspec
import pytest

from vx.core.request import RequestStatus
from vx.core.scheduler import Scheduler
from vx.messages import Logprobs, ModelRunnerOutput, SchedulerOutput

from .helpers import EOS, make_add_request, make_config, make_scheduler

COMMON = list(range(100, 148))


def result(out: SchedulerOutput, tokens: dict[str, list[int]] | None = None, **kw: object):
    """Rank 0's answer: the given tokens, [] (a prefill chunk) for everything else."""
    tokens = tokens or {}
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        step_id=out.step_id,
        req_ids=ids,
        sampled_token_ids=[tokens.get(i, []) for i in ids],
        **kw,  # type: ignore[arg-type]
    )


def decode_all(out: SchedulerOutput, token: int = 5) -> ModelRunnerOutput:
    return result(out, {i: [token] for i in out.num_scheduled_tokens})


def check(s) -> None:
    report = s.kv_self_check()
    assert report["ok"], report["problems"]


def test_chunked_prefill_running_first_under_the_budget() -> None:
    s = make_scheduler(64, max_num_batched_tokens=64)
    s.add_request(make_add_request("a", list(range(100))))
    s.add_request(make_add_request("b", list(range(200, 300))))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 64}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
    assert out.scheduled_new_reqs[0].block_ids == [0, 1, 2, 3]
    s.update_from_output(out, result(out))  # a prefill chunk: nothing sampled
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 36, "b": 28}
    assert out.total_num_scheduled_tokens == 64
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [64]
    assert out.scheduled_cached_reqs.new_block_ids == [[4, 5, 6]]
    outputs = s.update_from_output(out, result(out, {"a": [7]}))
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [7])]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 63}
    assert out.scheduled_cached_reqs.new_block_ids == [[], [9, 10, 11, 12]]
    check(s)


def test_max_num_seqs_and_long_prefill_threshold() -> None:
    s = make_scheduler(64, max_num_seqs=2, long_prefill_token_threshold=10)
    for i in range(3):
        s.add_request(make_add_request(f"r{i}", list(range(i * 50, i * 50 + 30))))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 10, "r1": 10}
    s.update_from_output(out, result(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 10, "r1": 10}
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_prefix_hit_advances_computed_without_scheduling() -> None:
    s = make_scheduler(64)
    s.add_request(make_add_request("a", COMMON + [1]))
    out = s.schedule()
    s.update_from_output(out, decode_all(out))
    s.add_request(make_add_request("b", COMMON + [2, 3]))
    out = s.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 48
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert new.block_ids[:3] == [0, 1, 2]  # the shared blocks
    outputs = s.update_from_output(out, decode_all(out))
    assert {o.request_id: o.num_cached_tokens for o in outputs} == {"a": 0, "b": 48}
    stats = s.make_stats()
    assert (stats.prefix_queries_total, stats.prefix_hits_total) == (49 + 50, 48)
    check(s)


def test_new_request_data_carries_everything_once() -> None:
    s = make_scheduler(64)
    s.add_request(make_add_request("a", [1, 2, 3], temperature=0.5, eos_token_id=9))
    out = s.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.prompt_token_ids == [1, 2, 3] and new.eos_token_id == 9
    assert new.sampling_params.temperature == 0.5
    assert new.output_token_ids == [] and new.num_computed_tokens == 0
    s.update_from_output(out, decode_all(out))
    out = s.schedule()
    assert out.scheduled_new_reqs == [] and out.scheduled_cached_reqs.req_ids == ["a"]


def test_preemption_takes_the_tail_and_resumes_it_first() -> None:
    # 4 blocks: a (16 tokens) and b (16 tokens) hold 1 block each and need a second one.
    s = make_scheduler(4, max_num_batched_tokens=64, max_model_len=64)
    s.add_request(make_add_request("a", list(range(16)), max_tokens=40, ignore_eos=True))
    s.add_request(make_add_request("b", list(range(50, 66)), max_tokens=40, ignore_eos=True))
    s.add_request(make_add_request("c", list(range(80, 90)), max_tokens=40, ignore_eos=True))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "b", "c"]
    s.update_from_output(out, decode_all(out))
    # Each needs a block for position 16 (a, b): 1 free block left after a takes its own.
    out = s.schedule()
    assert out.preempted_req_ids == ["c"]  # the tail, not b
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert out.scheduled_new_reqs == []  # no admissions in a step that preempted
    assert [r.request_id for r in s.waiting] == ["c"]
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.make_stats().num_preempted_total == 1
    check(s)
    s.update_from_output(out, decode_all(out, 6))
    # b and a keep growing; finish a so c can come back, carrying its output token.
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == "c" and resumed.output_token_ids == [5]
    assert resumed.prompt_token_ids == list(range(80, 90))
    # its prompt; its one output is recomputed in a step of its own, as the decode row it was
    # (`_prompt_end_cap`)
    assert out.num_scheduled_tokens["c"] == 10
    assert out.finished_req_ids == ["a"]
    check(s)


def test_a_request_that_cannot_grow_preempts_itself() -> None:
    s = make_scheduler(3, max_model_len=48)
    s.add_request(make_add_request("a", list(range(16)), max_tokens=10, ignore_eos=True))
    s.add_request(make_add_request("b", list(range(30, 46)), max_tokens=10, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, decode_all(out))
    out = s.schedule()  # a takes the last free block; b, the tail, is its own victim
    assert out.preempted_req_ids == ["b"] and list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in s.waiting] == ["b"] and [r.request_id for r in s.running] == ["a"]
    check(s)


@pytest.mark.parametrize(
    ("kwargs", "tokens", "expect_tokens", "reason", "stop_reason"),
    [
        ({}, [4, EOS, 6], [4, EOS], "stop", None),
        ({"ignore_eos": True, "max_tokens": 3}, [4, EOS, 6], [4, EOS, 6], "length", None),
        ({"stop_token_ids": [6]}, [4, 6], [4, 6], "stop", 6),
        ({"max_tokens": 2}, [4, 4, 4], [4, 4], "length", None),
        ({"min_tokens": 2}, [EOS, 6, EOS, EOS], [EOS, 6, EOS], "stop", None),
        ({"min_tokens": 1, "stop_token_ids": [7]}, [7, 7], [7, 7], "stop", 7),
        # a constrained request's EOS is its grammar's end (the Worker gives it only there)
        ({"min_tokens": 3, "structured_outputs": {"regex": "a"}}, [4, EOS], [4, EOS], "stop",
         None),
        ({"ignore_eos": True, "max_tokens": 3, "structured_outputs": {"regex": "a"}},
         [4, EOS, 6], [4, EOS], "stop", None),
    ],
)
def test_stop_conditions(kwargs, tokens, expect_tokens, reason, stop_reason) -> None:
    s = make_scheduler(16)
    s.add_request(make_add_request("r", [1, 2, 3], **kwargs))
    got: list[int] = []
    for token in tokens:
        out = s.schedule()
        outputs = s.update_from_output(out, decode_all(out, token))
        (o,) = outputs
        got += o.new_token_ids
        if o.finish_reason:
            assert (o.finish_reason, o.stop_reason) == (reason, stop_reason)
            break
    assert got == expect_tokens
    assert not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == ["r"] and out.total_num_scheduled_tokens == 0
    check(s)


def test_context_limit_finishes_with_length() -> None:
    s = make_scheduler(16, max_model_len=20)
    s.add_request(make_add_request("r", list(range(17)), max_tokens=None))
    n = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        assert max(out.scheduled_cached_reqs.num_computed_tokens, default=0) < 20
        (o,) = s.update_from_output(out, decode_all(out))
        n += 1
    assert n == 3 and o.finish_reason == "length"
    s.add_request(make_add_request("full", list(range(20))))  # = max_model_len: one token
    out = s.schedule()
    (o,) = s.update_from_output(out, decode_all(out))
    assert o.finish_reason == "length" and o.new_token_ids == [5]
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        s.add_request(make_add_request("long", list(range(21))))


def test_add_request_rejects_bad_input() -> None:
    s = make_scheduler(16)
    s.add_request(make_add_request("r", [1]))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_add_request("r", [1]))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_add_request("e", []))
    assert s.get_num_unfinished_requests() == 1


def test_max_model_len_is_capped_by_the_pool() -> None:
    s = make_scheduler(4, max_model_len=1000)
    assert s.max_model_len == 64


def test_abort_frees_blocks_at_once_and_is_idempotent() -> None:
    s = make_scheduler(16, max_num_seqs=1)
    s.add_request(make_add_request("a", list(range(40))))
    s.add_request(make_add_request("w", list(range(40))))  # stays waiting (max_num_seqs)
    out = s.schedule()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 16 - 3
    assert s.finish_requests(["a", "w", "zzz"], RequestStatus.FINISHED_ABORTED) == ["a", "w"]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 16
    assert s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []
    assert not s.running and not s.waiting and not s.has_unfinished_requests()
    # The in-flight step's tokens for the aborted request are dropped.
    assert s.update_from_output(out, decode_all(out)) == []
    out = s.schedule()
    assert out.finished_req_ids == ["a", "w"]
    check(s)


def test_empty_schedule_keeps_finished_ids_pending() -> None:
    s = make_scheduler(16)
    s.add_request(make_add_request("a", [1, 2]))
    s.add_request(make_add_request("b", [1, 2]))
    out = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ERROR)
    s.update_from_output(out, decode_all(out))
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    empty = s.schedule()
    assert empty.total_num_scheduled_tokens == 0 and empty.finished_req_ids == ["a", "b"]
    s.add_request(make_add_request("c", [3]))
    out = s.schedule()  # the first output that is really sent still names them
    assert out.finished_req_ids == ["a", "b"]
    assert s.schedule().finished_req_ids == []


def test_logprobs_are_carried_and_trimmed() -> None:
    s = make_scheduler(16)
    s.add_request(make_add_request("a", [1, 2, 3], max_tokens=2, logprobs=1, prompt_logprobs=1))
    out = s.schedule()
    lp = Logprobs(token_ids=[[4, 9]], logprobs=[[-0.1, -2.0]], ranks=[1])
    plp = Logprobs(token_ids=[[2], [3]], logprobs=[[-1.0], [-1.5]], ranks=[3, 2])
    (o,) = s.update_from_output(
        out, result(out, {"a": [4]}, logprobs=[lp], prompt_logprobs={"a": plp})
    )
    assert o.new_logprobs == lp and o.prompt_logprobs == plp
    # Several tokens in one step (e.g. speculative): trimmed at the stop, logprobs too.
    out = s.schedule()
    lp3 = Logprobs(token_ids=[[5], [6], [7]], logprobs=[[-1.0], [-2.0], [-3.0]], ranks=[1, 1, 1])
    (o,) = s.update_from_output(out, result(out, {"a": [5, 6, 7]}, logprobs=[lp3]))
    assert o.new_token_ids == [5] and o.finish_reason == "length"
    assert o.new_logprobs == Logprobs(token_ids=[[5]], logprobs=[[-1.0]], ranks=[1])


def test_prompt_logprobs_of_a_prefill_chunk_are_emitted() -> None:
    s = make_scheduler(16, max_num_batched_tokens=8)
    s.add_request(make_add_request("a", list(range(1, 13)), prompt_logprobs=0))
    out = s.schedule()
    plp = Logprobs(token_ids=[[i] for i in range(8)], logprobs=[[-1.0]] * 8, ranks=[1] * 8)
    (o,) = s.update_from_output(out, result(out, prompt_logprobs={"a": plp}))
    assert o.new_token_ids == [] and o.prompt_logprobs == plp and o.finish_reason is None


def test_stats_self_check_and_reset() -> None:
    s = make_scheduler(16)
    report = s.kv_self_check()
    assert report["ok"] and report["idle"] and report["num_free_blocks"] == 16
    s.add_request(make_add_request("a", list(range(20)), max_tokens=1))
    out = s.schedule()
    stats = s.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (1, 0, 14)
    assert stats.step_num_prefill_tokens == 20 and stats.step_num_decode_tokens == 0
    assert stats.kv_usage == pytest.approx(2 / 16)
    assert s.reset_prefix_cache() is False
    report = s.kv_self_check()
    assert report["ok"] and not report["idle"]
    # Corrupt the pool: the self-check names it.
    s.kv_cache_manager.req_to_blocks["a"][0].ref_cnt += 1
    assert not s.kv_self_check()["ok"]
    s.kv_cache_manager.req_to_blocks["a"][0].ref_cnt -= 1
    s.update_from_output(out, decode_all(out))
    assert s.make_stats().num_cached_free_blocks == 1
    assert s.reset_prefix_cache() is True
    assert s.make_stats().num_cached_free_blocks == 0


def test_caching_disabled_end_to_end() -> None:
    s = make_scheduler(16, enable_prefix_caching=False)
    for name in "ab":
        s.add_request(make_add_request(name, COMMON + [1]))
    out = s.schedule()
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0, 0]
    s.update_from_output(out, decode_all(out))
    assert s.make_stats().prefix_queries_total == 0
    check(s)


def test_finish_requests_tolerates_repeated_ids() -> None:
    s = make_scheduler(16)
    s.add_request(make_add_request("a", [1, 2]))
    s.schedule()
    assert s.finish_requests(["a", "a"], RequestStatus.FINISHED_ABORTED) == ["a"]
    check(s)


def test_several_tokens_in_one_step_fill_and_cache_blocks() -> None:
    s = make_scheduler(16)
    s.add_request(make_add_request("a", list(range(14)), max_tokens=30, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, result(out, {"a": [1, 2, 3, 4]}))  # crosses into block 1
    a = s.requests["a"]
    assert a.num_tokens == 18 and len(a.block_hashes) == 1
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}  # the three unseen outputs and the last
    assert s.kv_cache_manager.req_to_blocks["a"][0].block_hash == a.block_hashes[0]
    check(s)


def test_request_repr_keeps_the_prompt_out_of_logs() -> None:
    s = make_scheduler(16)
    s.add_request(make_add_request("secret", [31337, 4242]))
    text = repr(s.requests["secret"])
    assert "31337" not in text and "secret" in text


@pytest.mark.parametrize("burst", [0, 40])
def test_small_steps_while_few_requests_are_held(burst: int) -> None:
    """`small_step_tokens` caps a step while fewer than `small_step_running` requests run and
    are held (running or waiting); a burst of that many takes `burst_step_tokens` (0: the full
    budget) until that many run, and the small cap comes back once fewer are held again."""
    s = make_scheduler(
        128, max_num_batched_tokens=64, small_step_tokens=20, small_step_running=3,
        burst_step_tokens=burst,
    )  # fmt: skip
    for i in range(2):
        s.add_request(make_add_request(f"r{i}", list(range(30 * i, 30 * i + 30)), max_tokens=4))
    out = s.schedule()  # two held: 20 tokens
    assert out.num_scheduled_tokens == {"r0": 20}
    s.update_from_output(out, result(out))
    out = s.schedule()  # r0's rest first, then r1
    assert out.num_scheduled_tokens == {"r0": 10, "r1": 10}
    s.update_from_output(out, result(out, {"r0": [5]}))
    for i in range(2, 5):  # a burst: five held
        prompt = list(range(30 * i, 30 * i + 30))
        s.add_request(make_add_request(f"r{i}", prompt, max_tokens=4 * i))
    out = s.schedule()  # two running, five held: a burst step
    assert out.total_num_scheduled_tokens == (burst or 64)
    for _ in range(60):  # until they finish one by one and one (with "late": two) is held
        done = {r for r in out.num_scheduled_tokens if s.requests[r].num_computed_tokens
                >= s.requests[r].num_tokens}  # fmt: skip
        s.update_from_output(out, result(out, {r: [5] for r in done}))
        check(s)
        if len(s.running) + len(s.waiting) < 2:
            break
        out = s.schedule()
    else:
        raise AssertionError("the burst never drained")
    s.add_request(make_add_request("late", list(range(900, 930)), max_tokens=4))
    out = s.schedule()  # few held again: the late prompt comes 20 tokens at most
    assert 0 < out.num_scheduled_tokens["late"] <= 20 and out.total_num_scheduled_tokens <= 20
    check(s)


def test_small_steps_off_by_default() -> None:
    s = make_scheduler(64, max_num_batched_tokens=64)
    s.add_request(make_add_request("a", list(range(100))))
    assert s.schedule().total_num_scheduled_tokens == 64


def test_batch_invariant_recomputes_outputs_one_a_step() -> None:
    """`--batch-invariant`: a resumed request's chunk stops at its prompt's end, and its
    recomputed output tokens come one a step (decode rows, as they were first computed); a
    prompt is chunked as usual."""
    config = msgspec.structs.replace(
        make_config(max_num_batched_tokens=64, max_model_len=64), batch_invariant=True
    )
    s = Scheduler(config, 4)
    s.add_request(make_add_request("a", list(range(16)), max_tokens=40, ignore_eos=True))
    s.add_request(make_add_request("b", list(range(50, 66)), max_tokens=40, ignore_eos=True))
    s.add_request(make_add_request("c", list(range(80, 90)), max_tokens=40, ignore_eos=True))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 16, "b": 16, "c": 10}
    s.update_from_output(out, decode_all(out))
    out = s.schedule()
    assert out.preempted_req_ids == ["c"]
    s.update_from_output(out, decode_all(out, 6))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    (resumed,) = out.scheduled_new_reqs
    assert resumed.output_token_ids == [5]
    assert out.num_scheduled_tokens["c"] == 10  # the prompt alone
    s.update_from_output(out, result(out, {r: [7] for r in out.num_scheduled_tokens if r != "c"}))
    assert s.requests["c"].output_token_ids == [5]  # nothing sampled mid-recompute
    out = s.schedule()
    assert out.num_scheduled_tokens["c"] == 1  # its output, as a decode row
    s.update_from_output(out, decode_all(out, 8))
    assert s.requests["c"].output_token_ids == [5, 8]
    check(s)


def _spec_scheduler(num_blocks: int = 16, **kwargs: object) -> Scheduler:
    from vx.config import SpeculativeConfig

    config = msgspec.structs.replace(
        make_config(**kwargs),  # type: ignore[arg-type]
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    return Scheduler(config, num_blocks)


def test_drafts_do_not_count_against_a_small_step() -> None:
    """A small step's cap bounds its prompt work: running requests' drafts ride beside it (up to
    `max_num_batched_tokens`), so a waiting prompt gets the same share with drafting neighbours
    as without; without the headroom, drafts take what is left of the full budget."""
    s = _spec_scheduler(
        64, max_num_batched_tokens=30, small_step_tokens=12, small_step_running=8,
        async_scheduling=False,
    )  # fmt: skip
    for r in ("a", "b"):
        s.add_request(make_add_request(r, [1, 2, 3], max_tokens=20, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(
        out, result(out, {"a": [7], "b": [7]}, spec_token_ids={"a": [8, 9, 10], "b": [8, 9, 10]})
    )
    s.add_request(make_add_request("c", list(range(40, 80)), max_tokens=4))
    out = s.schedule()
    # a and b: 1 + 3 each, their 6 drafts past the cap of 12; c: the cap's other 10 tokens
    assert out.num_scheduled_tokens == {"a": 4, "b": 4, "c": 10}
    assert out.total_num_scheduled_tokens == 18
    check(s)
    s.update_from_output(
        out, result(out, {"a": [8, 9, 10, 11], "b": [8, 9, 10, 11]},
                    spec_token_ids={"a": [1, 2, 3], "b": [1, 2, 3]})
    )  # fmt: skip
    s.max_num_batched_tokens = 14  # headroom for 2 drafts: the rest come out of the cap
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 4, "c": 6}
    assert out.total_num_scheduled_tokens == 14
    check(s)


def test_drafts_are_scored_and_rejected_positions_rolled_back() -> None:
    """A request's drafts (from the worker's last output) ride its next step: 1 + k tokens
    scheduled, `scheduled_spec_decode_tokens` naming them; the step's tokens are its accepted
    drafts and its own, and its computed count goes back by the rejected ones."""
    s = _spec_scheduler(max_num_batched_tokens=64)
    s.add_request(make_add_request("a", list(range(10)), max_tokens=20, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, result(out, {"a": [7]}, spec_token_ids={"a": [8, 9, 10]}))
    a = s.requests["a"]
    assert a.spec_token_ids == [8, 9, 10] and a.num_tokens == 11
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    assert a.num_computed_tokens == 14 and a.spec_token_ids == []
    # two drafts held, the third not: 8, 9, then its own 42
    s.update_from_output(out, result(out, {"a": [8, 9, 42]}))
    assert a.all_token_ids[10:] == [7, 8, 9, 42]
    assert a.num_computed_tokens == 13 and a.num_tokens == 14  # the last token's KV is next
    stats = s.make_stats()
    assert stats.spec_num_draft_tokens_total == 3 and stats.spec_num_accepted_tokens_total == 2
    assert stats.spec_num_accepted_by_position == [1, 1, 0]
    out = s.schedule()  # no drafts came back: a plain decode
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_spec_decode_tokens == {}
    check(s)


def test_blocks_of_rejected_drafts_are_freed_and_hashes_cover_accepted_tokens() -> None:
    """A block that held rejected drafts only goes back to the pool when the request is next
    scheduled (the step sends the computed count the Worker trims its block table to); the
    prefix cache hashes the accepted tokens, never a draft."""
    s = _spec_scheduler(max_num_batched_tokens=64)
    kv = s.kv_cache_manager
    s.add_request(make_add_request("a", list(range(14)), max_tokens=20, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, result(out, {"a": [7]}, spec_token_ids={"a": [8, 9, 10]}))
    free = kv.block_pool.get_num_free_blocks()
    out = s.schedule()  # positions 14-17: a second block for the drafts 9 and 10
    assert out.scheduled_cached_reqs.new_block_ids == [[1]]
    assert kv.block_pool.get_num_free_blocks() == free - 1
    s.update_from_output(out, result(out, {"a": [42]}, spec_token_ids={"a": [8, 9]}))
    a = s.requests["a"]
    assert a.num_computed_tokens == 15 and kv.get_block_ids("a") == [0, 1]
    check(s)
    out = s.schedule()  # 15-17: block 1 freed first, then a second block again
    assert out.scheduled_cached_reqs.num_computed_tokens == [15]
    (second,) = out.scheduled_cached_reqs.new_block_ids[0]
    assert kv.block_pool.get_num_free_blocks() == free - 1
    # only the two tokens 42 and 8 hold
    s.update_from_output(out, result(out, {"a": [8, 5]}))
    assert a.num_computed_tokens == 17 and kv.get_block_ids("a") == [0, second]
    # block 0 is cached over [0..13, 7, 42] (accepted), not [0..13, 7, 8] (drafted)
    s.add_request(make_add_request("b", [*range(14), 7, 8, 9, 10, 1]))
    s.add_request(make_add_request("c", [*range(14), 7, 42, 8, 1]))
    out = s.schedule()
    hits = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    assert hits == {"b": 0, "c": 16}
    check(s)


def test_async_drafts_are_slots_and_the_output_takes_back_the_rejected_ones() -> None:
    """Async scheduling: a drafting request's next step is scheduled before its drafts come
    back, as k slots (-1) that count as accepted (computed and placed) until the step's
    output, which takes back what the Worker did not score or accept."""
    s = _spec_scheduler(max_num_batched_tokens=64, async_scheduling=True)
    s.add_request(make_add_request("a", list(range(10)), max_tokens=20, ignore_eos=True))
    a = s.requests["a"]
    out0 = s.schedule()  # the prompt
    out1 = s.schedule()  # its first token's step, before any drafts are known
    assert out1.num_scheduled_tokens == {"a": 1} and out1.scheduled_spec_decode_tokens == {}
    s.update_from_output(out0, result(out0, {"a": [7]}, spec_token_ids={"a": [8, 9]}))
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {"a": 4}
    assert out2.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    assert a.num_computed_tokens == 15 and a.num_output_placeholders == 5
    s.update_from_output(out1, result(out1, {"a": [8]}, spec_token_ids={"a": [9, 5]}))
    out3 = s.schedule()  # as if out2's three drafts all hold
    assert out3.scheduled_cached_reqs.num_computed_tokens == [15]
    assert out3.num_scheduled_tokens == {"a": 4} and a.num_computed_tokens == 19
    # out2: the Worker had two drafts for the three slots, and one held: 9, then its own 5
    s.update_from_output(
        out2, result(out2, {"a": [9, 5]}, spec_token_ids={"a": [1]}, spec_num_scored={"a": 2})
    )
    assert a.all_token_ids[10:] == [7, 8, 9, 5]
    assert a.num_computed_tokens == 17 and a.num_output_placeholders == 4
    stats = s.make_stats()
    assert stats.spec_num_draft_tokens_total == 2 and stats.spec_num_accepted_tokens_total == 1
    check(s)
    out4 = s.schedule()  # sends 17, the count out3 reaches if its three drafts hold
    assert out4.scheduled_cached_reqs.num_computed_tokens == [17]
    s.update_from_output(out3, result(out3, {"a": [1, 2, 3, 4]}))
    assert a.num_tokens == 18 and a.num_computed_tokens == 21
    assert a.num_output_placeholders == 4  # out4's token and three slots
    check(s)


def test_async_a_drafting_request_gets_slots_every_step_until_an_output_leaves_it_out() -> None:
    """Async scheduling: a request its latest output lists as drafting gets slots in every
    step scheduled after it, the next one too (no step consumes the listing), even where the
    Worker had no drafts just then (an empty list); an output that leaves it out stops them.
    Without async scheduling an empty list schedules no drafts."""
    s = _spec_scheduler(max_num_batched_tokens=64, async_scheduling=True)
    s.add_request(make_add_request("a", list(range(10)), max_tokens=40, ignore_eos=True))
    out0 = s.schedule()
    out1 = s.schedule()
    s.update_from_output(out0, result(out0, {"a": [7]}, spec_token_ids={"a": []}))
    out2 = s.schedule()
    assert out2.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    s.update_from_output(out1, result(out1, {"a": [8]}, spec_token_ids={"a": []}))
    out3 = s.schedule()  # out2 in flight: slots again
    assert out3.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    s.update_from_output(
        out2, result(out2, {"a": [9]}, spec_token_ids={}, spec_num_scored={"a": 0})
    )
    out4 = s.schedule()  # left out: no slots
    assert out4.num_scheduled_tokens == {"a": 1} and out4.scheduled_spec_decode_tokens == {}
    check(s)

    sync = _spec_scheduler(max_num_batched_tokens=64)
    sync.add_request(make_add_request("b", list(range(10)), max_tokens=40, ignore_eos=True))
    out = sync.schedule()
    sync.update_from_output(out, result(out, {"b": [7]}, spec_token_ids={"b": []}))
    out = sync.schedule()
    assert out.num_scheduled_tokens == {"b": 1} and out.scheduled_spec_decode_tokens == {}


def test_drafts_never_pass_the_length_limit_or_a_stop() -> None:
    s = _spec_scheduler(max_num_batched_tokens=64)
    s.add_request(make_add_request("a", list(range(10)), max_tokens=3, ignore_eos=True))
    s.add_request(make_add_request("b", list(range(20, 30)), max_tokens=20))
    out = s.schedule()
    s.update_from_output(
        out, result(out, {"a": [7], "b": [7]}, spec_token_ids={"a": [1, 2, 3], "b": [1, 2, 3]})
    )
    out = s.schedule()
    # a may emit 2 more tokens: 1 draft and its own
    assert out.scheduled_spec_decode_tokens == {"a": [1], "b": [1, 2, 3]}
    outputs = s.update_from_output(out, result(out, {"a": [1, 5], "b": [1, EOS, 3, 4]}))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["a"].new_token_ids == [1, 5] and by_id["a"].finish_reason == "length"
    # b stops at EOS: nothing after it is emitted
    assert by_id["b"].new_token_ids == [1, EOS] and by_id["b"].finish_reason == "stop"
    assert not s.running
    check(s)


def test_preemption_drops_the_drafts() -> None:
    s = _spec_scheduler(num_blocks=3, max_num_batched_tokens=64, max_model_len=48)
    s.add_request(make_add_request("a", list(range(16)), max_tokens=20, ignore_eos=True))
    s.add_request(make_add_request("b", list(range(20, 36)), max_tokens=20, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(
        out, result(out, {"a": [7], "b": [7]}, spec_token_ids={"a": [1, 2], "b": [1, 2]})
    )
    out = s.schedule()  # each needs a second block; one is free: b, the tail, is preempted
    assert out.preempted_req_ids == ["b"]
    assert s.requests["b"].spec_token_ids == [] and out.scheduled_spec_decode_tokens == {
        "a": [1, 2]
    }
    check(s)
def test_constrained_requests_are_counted_until_freed() -> None:
    """The dashboard's count: requests with a grammar, from admission to the one free funnel."""
    s = make_scheduler()
    s.add_request(make_add_request("free", [1, 2, 3]))
    s.add_request(make_add_request("json", [1, 2, 3], structured_outputs={"json_object": True}))
    s.add_request(make_add_request("re", [4, 5], structured_outputs={"regex": "[0-9]+"}))
    s.schedule()
    assert s.make_stats().num_constrained == 2
    s.finish_requests(["json", "free"], RequestStatus.FINISHED_ABORTED)
    assert s.make_stats().num_constrained == 1
    s.finish_requests("re", RequestStatus.FINISHED_ABORTED)
    assert s.make_stats().num_constrained == 0


def test_pipeline_parallel_splits_steps_and_sends_known_tokens() -> None:
    """PP = 2 (async scheduling asked for, as by default): two steps in flight take disjoint
    halves of the running requests; a request is not scheduled again until its step's token
    is back (no placeholders); that token then travels to the earlier stages in
    `new_token_ids`, prompt tokens never do; an abort between the steps frees at once."""
    config = make_config(max_num_batched_tokens=256, async_scheduling=True)
    config = msgspec.structs.replace(
        config, parallel=msgspec.structs.replace(config.parallel, pipeline_parallel_size=2)
    )
    s = Scheduler(config, 64)
    for i in range(4):
        s.add_request(make_add_request(f"r{i}", [1, 2, 3 + i], max_tokens=8))
    a = s.schedule()
    b = s.schedule()
    assert list(a.num_scheduled_tokens) == ["r0", "r1"]
    assert list(b.num_scheduled_tokens) == ["r2", "r3"]
    assert s.schedule().total_num_scheduled_tokens == 0  # everyone is in flight
    s.update_from_output(a, decode_all(a, token=7))
    c = s.schedule()
    assert c.scheduled_cached_reqs.req_ids == ["r0", "r1"]
    assert c.scheduled_cached_reqs.new_token_ids == [[7], [7]]
    assert all(s.requests[r].num_output_placeholders == 0 for r in s.requests)
    s.finish_requests("r2", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(b, decode_all(b, token=9))  # r2's token is dropped
    d = s.schedule()
    assert d.scheduled_cached_reqs.req_ids == ["r3"] and d.finished_req_ids == ["r2"]
    assert d.scheduled_cached_reqs.new_token_ids == [[9]]
    check(s)
