"""Message <-> bytes for the rings: typed msgpack through msgspec, never pickle.

Runs in: every process. One `Codec` per ring direction decodes exactly that ring's union
(`vx.messages.EngineCoreInput`, ...), so a message of the wrong kind fails loudly.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from vx import messages

T = TypeVar("T")


class Codec(Generic[T]):
    """Encodes any message; decodes only members of the union it was built for."""

    __slots__ = ("_decoder", "_encoder")

    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def encode(self, msg: T) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> T:
        return self._decoder.decode(data)


def engine_input_codec() -> Codec[messages.EngineCoreInput]:
    return Codec(messages.EngineCoreInput)


def engine_event_codec() -> Codec[messages.EngineCoreEvent]:
    return Codec(messages.EngineCoreEvent)


def worker_input_codec() -> Codec[messages.WorkerInput]:
    return Codec(messages.WorkerInput)


def worker_event_codec() -> Codec[messages.WorkerEvent]:
    return Codec(messages.WorkerEvent)
