"""Async scheduling: output placeholders let step n+1 be scheduled before step n's tokens."""

from __future__ import annotations

from vx.core.request import RequestStatus
from vx.messages import ModelRunnerOutput, SchedulerOutput

from .helpers import EOS, Driver, FakeWorker, make_add_request, make_scheduler


def decode_all(out: SchedulerOutput, token: int = 5) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        step_id=out.step_id, req_ids=ids, sampled_token_ids=[[token]] * len(ids)
    )


def test_placeholder_lets_the_next_step_schedule_the_next_token() -> None:
    s = make_scheduler(16, async_scheduling=True)
    s.add_request(make_add_request("a", list(range(10)), max_tokens=100))
    out0 = s.schedule()
    a = s.requests["a"]
    assert out0.num_scheduled_tokens == {"a": 10} and a.num_output_placeholders == 1
    out1 = s.schedule()  # before step 0's output: schedules position 10, a placeholder
    assert out1.num_scheduled_tokens == {"a": 1}
    assert out1.scheduled_cached_reqs.num_computed_tokens == [10]
    assert a.num_output_placeholders == 2 and a.num_tokens == 10
    (o,) = s.update_from_output(out0, decode_all(out0, 7))
    assert o.new_token_ids == [7]
    assert a.num_output_placeholders == 1 and a.all_token_ids[-1] == 7
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {"a": 1}
    assert out2.scheduled_cached_reqs.num_computed_tokens == [11]


def test_prefill_chunks_get_no_placeholder() -> None:
    s = make_scheduler(16, async_scheduling=True, max_num_batched_tokens=8)
    s.add_request(make_add_request("a", list(range(20))))
    s.schedule()
    assert s.requests["a"].num_output_placeholders == 0
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 8}
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert s.requests["a"].num_output_placeholders == 1


def test_finish_at_step_n_discards_step_n_plus_1() -> None:
    s = make_scheduler(16, async_scheduling=True)
    s.add_request(make_add_request("a", [1, 2, 3]))
    out0 = s.schedule()
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"a": 1}
    (o,) = s.update_from_output(out0, decode_all(out0, EOS))
    assert o.finish_reason == "stop"
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 16  # freed at once
    out2 = s.schedule()
    assert out2.finished_req_ids == ["a"]
    assert s.update_from_output(out1, decode_all(out1, 9)) == []  # dropped, no output
    assert s.kv_self_check()["ok"]


def test_in_flight_tokens_reaching_max_tokens_stop_scheduling() -> None:
    s = make_scheduler(16, async_scheduling=True)
    s.add_request(make_add_request("a", [1, 2, 3], max_tokens=2, ignore_eos=True))
    out0 = s.schedule()
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"a": 1}
    out2 = s.schedule()  # two tokens in flight already reach max_tokens: nothing to do
    assert out2.total_num_scheduled_tokens == 0
    (o0,) = s.update_from_output(out0, decode_all(out0, 4))
    (o1,) = s.update_from_output(out1, decode_all(out1, 5))
    assert (o0.finish_reason, o1.new_token_ids, o1.finish_reason) == (None, [5], "length")


def test_abort_between_schedule_and_update() -> None:
    s = make_scheduler(16, async_scheduling=True)
    s.add_request(make_add_request("a", [1, 2, 3]))
    s.add_request(make_add_request("b", [1, 2, 3]))
    out0 = s.schedule()
    out1 = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outputs = s.update_from_output(out0, decode_all(out0))
    assert [o.request_id for o in outputs] == ["b"]
    outputs = s.update_from_output(out1, decode_all(out1))
    assert [o.request_id for o in outputs] == ["b"]
    assert s.requests["b"].num_output_placeholders == 0
    assert s.schedule().finished_req_ids == ["a"]


def test_preempted_request_drops_its_in_flight_token_and_recovers() -> None:
    # Three 16-token prompts in 4 blocks: the second decode step needs 3 new blocks.
    eos = None
    sync = Driver(make_scheduler(4, max_model_len=64), FakeWorker())
    asyn = Driver(make_scheduler(4, max_model_len=64, async_scheduling=True), FakeWorker())
    for d in (sync, asyn):
        for i in range(3):
            d.scheduler.add_request(
                make_add_request(
                    f"r{i}", list(range(i * 16, i * 16 + 16)), max_tokens=8, eos_token_id=eos
                )
            )
        d.run()
        assert d.scheduler.num_preempted_total > 0
        assert d.scheduler.kv_self_check()["ok"]
    assert sync.tokens == asyn.tokens and sync.finish == asyn.finish
    assert all(len(t) == 8 for t in sync.tokens.values())
