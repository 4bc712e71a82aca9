"""EngineClient and RequestStream: merging mailboxes, the outbox, start-up and death."""

from __future__ import annotations

import anyio
import pytest

from tests.http.fake_engine import RING_PREFIX
from vx import messages
from vx.errors import EngineDeadError
from vx.http.engine_client import EngineClient, RequestStream
from vx.ipc import codec
from vx.ipc.ring import RingReader, RingWriter

pytestmark = pytest.mark.anyio


def _out(request_id: str, ids: list[int], finish: str | None = None) -> messages.EngineCoreOutput:
    lp = messages.Logprobs(
        token_ids=[[t] for t in ids], logprobs=[[-1.0] for _ in ids], ranks=[1] * len(ids)
    )
    return messages.EngineCoreOutput(request_id, ids, finish, new_logprobs=lp)


async def test_slow_reader_gets_merged_deltas() -> None:
    stream = RequestStream("r", 0, limit=2)
    for i in range(100):
        stream.put(_out("r", [i]))
    stream.put(_out("r", [100], "length"))
    assert len(stream._queue) == 2  # bounded: everything else merged into the newest delta
    first = await stream.get()
    assert first.new_token_ids == [0]
    rest = [await stream.get()]  # the merged delta, in pieces of at most DELIVER_MAX_TOKENS
    while not rest[-1].finished:
        rest.append(await stream.get())
    assert [len(d.new_token_ids) for d in rest] == [64, 36]
    assert [t for d in rest for t in d.new_token_ids] == list(range(1, 101))
    assert rest[-1].finish_reason == "length"
    assert sum(len(d.logprobs) for d in rest) == 100
    stream.put(_out("r", [7]))  # after the final delta nothing is accepted
    with pytest.raises(anyio.EndOfStream):
        await stream.get()


async def test_get_waits_and_is_cancel_safe() -> None:
    stream = RequestStream("r", 0)
    with anyio.move_on_after(0.01):
        await stream.get()
    stream.put(_out("r", [1]))
    stream.put_final("abort")
    delta = await stream.get()
    assert delta.new_token_ids == [1] and delta.finish_reason == "abort"


def _engine_rings(capacity: int) -> tuple[RingWriter, RingReader, RingWriter, RingReader]:
    to_engine = RingWriter.create(capacity=capacity, name_prefix=RING_PREFIX)
    engine_in = RingReader.attach(to_engine.handle)
    engine_out = RingWriter.create(capacity=1 << 16, name_prefix=RING_PREFIX)
    from_engine = RingReader.attach(engine_out.handle)
    return to_engine, engine_in, engine_out, from_engine


def _ready(index: int = 0) -> bytes:
    return codec.engine_event_codec().encode(
        messages.EngineReady(
            engine_index=index, num_blocks=8, block_size=16, max_model_len=128,
            max_num_batched_tokens=256, max_num_seqs=8, kv_cache_bytes=1, engine_pid=1,
            worker_pids=[], async_scheduling=False,
        )
    )  # fmt: skip


async def test_full_input_ring_queues_in_order() -> None:
    rings = _engine_rings(capacity=1024)
    to_engine, engine_in, engine_out, from_engine = rings
    try:
        client = EngineClient([(to_engine, from_engine)])
        engine_out.send(_ready())
        params = messages.SamplingParams.create(max_tokens=4)
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            for i in range(40):  # far more than 1 KiB of AddRequests: most wait in the outbox
                client.add_request(
                    messages.AddRequest(
                        request_id=f"r{i}", prompt_token_ids=[1, 2, 3], sampling_params=params
                    )
                )
            client.abort_nowait(["r0", "r39"], "client_disconnect")
            assert sum(map(len, client._outbox)) > 0
            decode = codec.engine_input_codec().decode
            got: list[messages.EngineCoreInput] = []
            with anyio.fail_after(5):
                while len(got) < 41:
                    try:
                        got.append(decode(engine_in.recv_nowait()))
                    except anyio.WouldBlock:
                        await anyio.sleep(0.001)
            assert [m.request_id for m in got[:40]] == [f"r{i}" for i in range(40)]
            assert got[40] == messages.AbortRequests(
                request_ids=["r0", "r39"], cause="client_disconnect"
            )
            assert client.num_unfinished == 38
            tg.cancel_scope.cancel()
    finally:
        for end in rings:
            end.close()


async def test_engine_dead_before_ready_fails_start() -> None:
    rings = _engine_rings(capacity=1 << 16)
    to_engine, engine_in, engine_out, from_engine = rings
    try:
        client = EngineClient([(to_engine, from_engine)])
        engine_out.send(
            codec.engine_event_codec().encode(messages.EngineDead(engine_index=0, reason="OOM"))
        )
        with pytest.raises(EngineDeadError, match="OOM"):
            await client.run()  # never calls task_status.started()
        assert client.is_dead and "OOM" in (client.dead_reason or "")
    finally:
        for end in rings:
            end.close()


async def test_closed_output_ring_marks_dead_with_requests_in_flight() -> None:
    rings = _engine_rings(capacity=1 << 16)
    to_engine, engine_in, engine_out, from_engine = rings
    try:
        client = EngineClient([(to_engine, from_engine)])
        engine_out.send(_ready())
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            stream = client.add_request(
                messages.AddRequest(
                    request_id="a",
                    prompt_token_ids=[1],
                    sampling_params=messages.SamplingParams.create(),
                )
            )
            engine_out.close()  # the engine went away with "a" unfinished
            delta = await stream.get()
            assert delta.finish_reason == "error" and "engine dead" in (delta.error or "")
        assert client.is_dead
        with pytest.raises(EngineDeadError):
            client.add_request(
                messages.AddRequest(
                    request_id="b",
                    prompt_token_ids=[1],
                    sampling_params=messages.SamplingParams.create(),
                )
            )
        with pytest.raises(EngineDeadError):
            await client.call_utility("get_stats")
    finally:
        for end in rings:
            end.close()


async def test_wait_idle() -> None:
    rings = _engine_rings(capacity=1 << 16)
    to_engine, engine_in, engine_out, from_engine = rings
    try:
        client = EngineClient([(to_engine, from_engine)])
        engine_out.send(_ready())
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            await client.wait_idle()  # nothing in flight: returns at once
            client.add_request(
                messages.AddRequest(
                    request_id="a",
                    prompt_token_ids=[1],
                    sampling_params=messages.SamplingParams.create(),
                )
            )
            done = anyio.Event()

            async def drain() -> None:
                await client.wait_idle()
                done.set()

            tg.start_soon(drain)
            await anyio.sleep(0)
            assert not done.is_set()
            outs = messages.EngineCoreOutputs(
                engine_index=0, outputs=[_out("a", [5], "stop")], timestamp=0.0
            )
            engine_out.send(codec.engine_event_codec().encode(outs))
            with anyio.fail_after(5):
                await done.wait()
            tg.cancel_scope.cancel()
    finally:
        for end in rings:
            end.close()


def test_startup_banner() -> None:
    from vx.config import EngineConfig, ModelConfig
    from vx.http.serve import startup_banner

    config = EngineConfig(
        model=ModelConfig(model="smollm2-135m", path="/m", served_model_name="smol")
    )
    ready = messages.EngineReady(
        engine_index=0, num_blocks=100, block_size=16, max_model_len=2048, max_num_batched_tokens=8192,
        max_num_seqs=256, kv_cache_bytes=2**30, engine_pid=11, worker_pids=[12], async_scheduling=True,
    )  # fmt: skip
    text = startup_banner(config, [ready], "http://127.0.0.1:8000", 3.21)
    assert "serving 'smol' at http://127.0.0.1:8000" in text and "100 blocks" in text
    assert "max_model_len 2048" in text and "(ready in 3.2 s)" in text


async def test_cancel_never_loses_a_queued_delta() -> None:
    stream = RequestStream("r", 0)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await stream.get()  # nothing queued: the wait is cancelled
        raise AssertionError("not reached")
    stream.put(_out("r", [1]))
    with anyio.CancelScope() as scope:
        scope.cancel()
        delta = await stream.get()  # queued: taken whole, even in a cancelled scope
    assert delta.new_token_ids == [1]
    with pytest.raises(anyio.WouldBlock):
        stream.get_nowait()


@pytest.mark.parametrize(
    ("widths", "vocab", "max_bytes"),
    [
        ((1, 2, 3, 4), 50_000, None),  # rows of every width: a segment per run of one width
        ((21,), 50_000, 170),  # 20 logprobs, ids in 2 bytes: 2 + 2 + 21 * (2 + 4) = 130
        ((21,), 150_000, 220),  # a vocabulary past 65,536: ids in 4 bytes (180)
    ],
)
def test_a_reader_far_behind_gets_every_token_and_row_exactly(
    widths: tuple[int, ...], vocab: int, max_bytes: int | None
) -> None:
    """Past `PACK_FROM_TOKENS` undelivered tokens the mailbox packs tokens, ranks and logprob
    rows into arrays of 2- or 4-byte numbers; what the reader gets is what the engine sent, in
    order, with the fp32 logprobs exact, and rows of any width. Packed, a token with its row
    costs its numbers plus a share of its segment's objects, about 200 bytes a segment (Python
    lists: over a kilobyte)."""
    import sys

    import torch

    from vx.http.engine_client import DELIVER_MAX_TOKENS, PACK_FROM_TOKENS

    g = torch.Generator().manual_seed(0)
    s = RequestStream("r", 0)
    sent_tokens, sent_ids, sent_vals, sent_ranks = [], [], [], []
    n = 40 * PACK_FROM_TOKENS + 5
    for i in range(n):
        k = widths[i % len(widths)]
        vals = torch.randn(k, generator=g).log_softmax(0).tolist()  # fp32 values, as the Worker's
        ids = torch.randint(0, vocab, (k,), generator=g).tolist()
        rank = torch.randint(1, vocab + 1, (), generator=g).item()
        out = messages.EngineCoreOutput(
            request_id="r", new_token_ids=[ids[0]],
            new_logprobs=messages.Logprobs(token_ids=[ids], logprobs=[vals], ranks=[rank]),
            finish_reason="length" if i == n - 1 else None,
        )  # fmt: skip
        s.put(out)
        sent_tokens.append(ids[0])
        sent_ids.append(ids)
        sent_vals.append(vals)
        sent_ranks.append(rank)
    # every output merged, then handed out in pieces of at most DELIVER_MAX_TOKENS packed tokens
    deltas = []
    while not deltas or not deltas[-1].finished:
        deltas.append(s.get_nowait())
    assert len(deltas) == -(-n // DELIVER_MAX_TOKENS)
    assert all(len(d.new_token_ids) <= DELIVER_MAX_TOKENS for d in deltas)
    with pytest.raises(anyio.EndOfStream):
        s.get_nowait()
    assert [t for d in deltas for t in d.new_token_ids] == sent_tokens
    assert [r for d in deltas for r in d.logprob_token_ids] == sent_ids
    assert [r for d in deltas for r in d.logprobs] == sent_vals
    assert [r for d in deltas for r in d.ranks] == sent_ranks
    assert deltas[-1].finish_reason == "length"
    if max_bytes is not None:
        segs = [g for d in deltas for g in d._segments]
        size = sum(sys.getsizeof(x) for g in segs for x in (g, g.ints, g.vals))
        packed = sum(g.n for g in segs)
        assert size / packed < max_bytes, size / packed
