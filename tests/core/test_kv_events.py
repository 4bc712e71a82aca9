"""The BlockPool's KV events against the prefix cache it reports on.

A subscriber's view, rebuilt from the wire bytes alone with vLLM's published event schema
(msgspec Structs defined here, positional and tagged as vllm/distributed/kv_events.py has them),
must equal the pool's map after every engine step of a random workload whose pool is small
enough to evict, and after a reset of the prefix cache.
"""

from __future__ import annotations

import random

import msgspec

from vx.config import KVEventsConfig
from vx.core.kv_events import KVEventBatch, external_hash
from vx.core.scheduler import Scheduler

from .helpers import Driver, FakeWorker, make_add_request, make_config


# vLLM's schema, as a router written against it holds it.
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class Index:
    """What a router keeps: the hashes a replica holds, from its event stream alone."""

    def __init__(self) -> None:
        self.hashes: set[int | bytes] = set()
        self.decode = msgspec.msgpack.Decoder(EventBatch).decode

    def apply(self, payload: bytes) -> EventBatch:
        batch = self.decode(payload)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                assert not self.hashes & set(ev.block_hashes), "stored twice without a removal"
                self.hashes |= set(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= self.hashes, "removed a hash never stored"
                self.hashes -= set(ev.block_hashes)
            else:
                self.hashes.clear()
        return batch


def cached(scheduler: Scheduler) -> set[int]:
    pool = scheduler.kv_cache_manager.block_pool
    return {external_hash(h) for h in pool.cached_block_hash_to_block}


def test_events_replay_to_the_prefix_cache() -> None:
    config = msgspec.structs.replace(
        make_config(max_num_batched_tokens=48, async_scheduling=True),
        kv_events=KVEventsConfig(enable_kv_cache_events=True),
    )
    scheduler = Scheduler(config, 12)  # 12 blocks of 16: evictions from the third request on
    driver = Driver(scheduler, FakeWorker(eos_rate=0))
    pool = scheduler.kv_cache_manager.block_pool
    encode = msgspec.msgpack.Encoder().encode
    index = Index()
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 40) for _ in range(48)] for _ in range(3)]
    kinds: set[str] = set()
    for i in range(40):
        prompt = prefixes[i % 3][: rng.choice([16, 32, 48])] + [rng.randrange(1, 40)] * (i % 7)
        scheduler.add_request(make_add_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 20)))
        for _ in range(rng.randrange(1, 6)):
            driver.step()
            events = pool.take_events()
            kinds |= {type(e).__name__ for e in events}
            if events:
                batch = index.apply(encode(KVEventBatch(ts=1.0, events=events,
                                                        data_parallel_rank=0)))  # fmt: skip
                assert batch.data_parallel_rank == 0
                assert all(e.medium == "CPU" for e in batch.events if hasattr(e, "medium"))
            assert index.hashes == cached(scheduler)
    driver.run()
    index.apply(encode(KVEventBatch(ts=2.0, events=pool.take_events())))
    assert index.hashes == cached(scheduler) and index.hashes
    assert scheduler.reset_prefix_cache()
    index.apply(encode(KVEventBatch(ts=3.0, events=pool.take_events())))
    assert index.hashes == cached(scheduler) == set()
    assert kinds == {"BlockStored", "BlockRemoved"}


def test_stored_runs_chain_through_their_parents() -> None:
    """A prompt of three blocks, then one that shares its first two: the second announces only
    its third block, with the shared second block's hash as its parent."""
    config = msgspec.structs.replace(
        make_config(), kv_events=KVEventsConfig(enable_kv_cache_events=True)
    )
    scheduler = Scheduler(config, 32)
    driver = Driver(scheduler, FakeWorker())
    pool = scheduler.kv_cache_manager.block_pool
    a = list(range(1, 49)) + [5]
    b = list(range(1, 33)) + [7] * 16 + [5]
    scheduler.add_request(make_add_request("a", a, max_tokens=1))
    driver.run()
    (first,) = pool.take_events()
    assert first.parent_block_hash is None and first.token_ids == a[:48]
    scheduler.add_request(make_add_request("b", b, max_tokens=1))
    driver.run()
    (second,) = pool.take_events()
    assert second.parent_block_hash == first.block_hashes[1]
    assert second.token_ids == b[32:48] and len(second.block_hashes) == 1
    assert pool.take_events() == []


def test_off_records_nothing() -> None:
    scheduler = Scheduler(make_config(), 8)
    driver = Driver(scheduler, FakeWorker())
    scheduler.add_request(make_add_request("a", list(range(1, 40)), max_tokens=4))
    driver.run()
    assert scheduler.kv_cache_manager.block_pool.take_events() == []


def test_kv_events_config_takes_vllms_keys() -> None:
    import pytest

    from vx.config import EngineConfig, parse_kv_events_config
    from vx.core.kv_events import offset_endpoint_port

    c = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "hwm": 10, '
        '"max_queue_size": 5, "topic": "kv"}'
    )
    assert c.enabled and c.topic == "kv" and c.replay_endpoint == "tcp://*:5558"
    assert not parse_kv_events_config(None).enabled
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).enabled
    with pytest.raises(ValueError, match="unknown keys"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "port": 1}')
    cache = msgspec.structs.replace(make_config().cache, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(cache=cache, kv_events=c).validate()
    # data-parallel rank r publishes on port + r, as vLLM's ranks do
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("ipc://kv-events", 1) == "ipc://kv-events_dp1"


# vLLM's first schema (no `medium`, no `data_parallel_rank`).
class FirstEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class FirstStored(FirstEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class FirstRemoved(FirstEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class FirstBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[FirstStored | FirstRemoved]


def test_the_first_published_schema_decodes_it_too() -> None:
    """vLLM's first schema reads vx's batches: msgspec ignores the trailing fields a
    positional struct does not know."""
    from vx.core.kv_events import BlockRemoved as VxRemoved, BlockStored as VxStored

    raw = msgspec.msgpack.encode(
        KVEventBatch(
            ts=1.0,
            events=[
                VxStored(block_hashes=[3], parent_block_hash=2, token_ids=[1] * 16,
                         block_size=16, lora_id=None, medium="CPU"),  # fmt: skip
                VxRemoved(block_hashes=[3], medium="CPU"),
            ],
            data_parallel_rank=1,
        )
    )
    batch = msgspec.msgpack.decode(raw, type=FirstBatch)
    assert batch.events == [FirstStored([3], 2, [1] * 16, 16, None), FirstRemoved([3])]
