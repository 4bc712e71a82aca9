"""Prefix-cache block hashes: a SHA-256 chain over full blocks of token ids.

Runs in: EngineCore.

``hash(block i) = SHA-256(hash(block i-1) || msgpack([token ids of block i, extra keys]))``,
with `NONE_HASH` standing in for the parent of block 0. The encoding is injective (the parent
is a fixed 32 bytes and msgpack is self-delimiting), so equal hashes mean equal *prefixes*
(tokens of every block so far and the extra keys), not merely equal blocks, up to SHA-256
collisions. The root is a constant, so hashes are stable across restarts and processes.

Extra keys isolate tenants and adapters that share a prefix: the LoRA id and the cache salt
are mixed into block 0, and the chain carries them into every later block. Multimodal inputs
(none in vx yet) would add (mm hash, offset) keys to the blocks they overlap.
"""

from __future__ import annotations

import hashlib

import msgspec

from vx.core.request import Request

__all__ = ["NONE_HASH", "hash_block_tokens", "request_extra_keys", "update_block_hashes"]

#: The parent hash of every request's first block.
NONE_HASH: bytes = hashlib.sha256(b"vx prefix cache root v1").digest()

_encode = msgspec.msgpack.Encoder().encode
_sha256 = hashlib.sha256


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: list[int], extra_keys: tuple[object, ...] | None = None
) -> bytes:
    """The hash of one full block given its parent's hash (None for the first block)."""
    payload = _encode(token_ids if extra_keys is None else (token_ids, extra_keys))
    return _sha256((parent_hash or NONE_HASH) + payload).digest()


def request_extra_keys(request: Request) -> tuple[object, ...] | None:
    """The extra keys of a request's first block, or None when it has none."""
    if request.lora_id is None and request.cache_salt is None:
        return None
    return ("lora", request.lora_id, "salt", request.cache_salt)


def update_block_hashes(request: Request, block_size: int) -> None:
    """Hash every full block of known tokens not hashed yet (incremental: each block once)."""
    hashes = request.block_hashes
    start = len(hashes)
    end = request.num_tokens // block_size
    if start >= end:
        return
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else NONE_HASH
    for i in range(start, end):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        if i == 0:
            parent = hash_block_tokens(None, chunk, request_extra_keys(request))
        else:
            parent = _sha256(parent + _encode(chunk)).digest()
        hashes.append(parent)
