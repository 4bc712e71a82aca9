"""KV-cache events for cache-aware routers: vLLM's wire schema and its ZMQ publisher.

Runs in: EngineCore. The BlockPool records an event as a block enters its hash map
(`BlockStored`), leaves it on eviction (`BlockRemoved`) or when the whole map is dropped
(`AllBlocksCleared`); the EngineCore takes them once per loop turn and publishes one
`KVEventBatch`. This is an external interface (llm-d's precise prefix-cache scorer, Dynamo's KV
router and vLLM's own subscriber example read it), so it speaks their transport, ZMQ PUB, and
stays outside vx's internal rings. pyzmq is imported only when `--kv-events-config` turns the
publisher on (the `kv-events` extra).

Wire format, as vLLM publishes it (vllm/distributed/kv_events.py): a three-frame message
``[topic, seq as 8 bytes big-endian, msgpack(KVEventBatch)]``; the batch and each event are
msgspec `array_like` structs (positional arrays), an event's first element its tag (the class
name). This positional form is the one every consumer decodes (vLLM later moved its events to
tagged maps, and the routers accept both). A replay ROUTER socket, when configured, answers a
request ``[b"", start seq as 8 bytes]`` with every buffered ``[seq, payload]`` from there on and
then ``[-1 as 8 bytes, b""]``.

Block hashes: vx's own prefix-cache hash (the SHA-256 chain of `vx/core/block_hash.py`), sent
as vLLM sends its SHA-256 hashes by default: the digest's low 64 bits (its last eight bytes,
big-endian) as an unsigned integer. A router uses them as opaque names and chains them through
`parent_block_hash`; the token ids ride along, so one that hashes tokens itself can map them.

Invariant: replaying every batch in order, the stored hashes minus the removed ones (and none
after an `AllBlocksCleared`) are exactly the hashes in the pool's map (tests/core).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import count
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from vx.config import KVEventsConfig

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "ZmqEventPublisher",
    "external_hash",
    "offset_endpoint_port",
]

logger = logging.getLogger(__name__)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """A run of consecutive full blocks of one prefix entered the map."""

    block_hashes: list[int]
    #: The hash of the block before the first one, None at a prompt's start.
    parent_block_hash: int | None
    #: Every token of the run, block after block.
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    #: "GPU" for the cuda device's pool, "CPU" for the CPU device's (host memory).
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """vx's 32-byte block hash as the event's integer: its low 64 bits (vLLM's default form)."""
    return int.from_bytes(block_hash[-8:], "big")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Data-parallel rank r publishes on the endpoint's port + r (vLLM's rule; an ipc or
    inproc endpoint gets a `_dp<r>` suffix)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + data_parallel_rank}"


class ZmqEventPublisher:
    """A PUB socket (bound when the endpoint has a wildcard or is ipc/inproc, else connected,
    as vLLM does), a ring of the last `buffer_steps` payloads and, with a replay endpoint, a
    ROUTER socket served by one daemon thread.

    `publish` runs on the EngineCore's thread and never blocks: a PUB socket drops what a slow
    subscriber cannot take past `hwm` (that subscriber then asks for a replay). The replay
    thread owns its ROUTER socket alone and reads the ring through a copy.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int) -> None:
        import zmq  # the `kv-events` extra, needed only when the publisher is on

        self._zmq = zmq
        self._rank = data_parallel_rank
        self._ctx = zmq.Context()
        # Nothing queued may hold the process at exit (an engine that dies exits at once).
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        assert endpoint is not None
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = endpoint
        self._topic = config.topic.encode()
        self._seq = count()
        self._encode = msgspec.msgpack.Encoder().encode
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        replay = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        if replay is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.bind(replay)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()
        logger.info("KV events published on %s (topic %r)", endpoint, config.topic)

    def publish(self, events: list[Any]) -> None:
        """Send one batch of this loop turn's events (in the order the pool recorded them)."""
        payload = self._encode(
            KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
        )
        seq = next(self._seq)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart(
                (self._topic, seq.to_bytes(8, "big"), payload), flags=self._zmq.NOBLOCK
            )
        except self._zmq.Again:  # no room past the high-water mark: the replay ring has it
            pass

    def _serve_replay(self, router: Any) -> None:
        zmq = self._zmq
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    logger.warning("KV events: a replay request of %d frames", len(frames))
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):  # a copy: publish() appends meanwhile
                    if seq >= first:
                        router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                router.send_multipart((client, b"", self.END_SEQ, b""))
        except zmq.ZMQError as e:  # the context closed under us at shutdown
            if not self._stop.is_set():
                logger.error("KV events replay stopped: %s", e)
        finally:
            router.close(linger=0)

    def shutdown(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=1.0)
        self._pub.close(linger=0)
        self._ctx.term()
