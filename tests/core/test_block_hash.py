"""Block hashes: a stable SHA-256 chain; equal hashes iff equal prefixes (and extra keys)."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings, strategies as st

from vx.core.block_hash import NONE_HASH, hash_block_tokens, update_block_hashes

from .helpers import make_request


def test_root_is_stable_across_processes() -> None:
    # A constant, not a per-process random seed: cached hashes mean the same after a restart.
    assert NONE_HASH == hashlib.sha256(b"vx prefix cache root v1").digest()
    assert hash_block_tokens(None, list(range(16))) == hash_block_tokens(NONE_HASH, list(range(16)))


def test_only_full_blocks_are_hashed_incrementally() -> None:
    request = make_request("r", list(range(40)))
    assert len(request.block_hashes) == 2  # 40 tokens: two full blocks
    first = list(request.block_hashes)
    for t in range(8):
        request.append_output_token_id(100 + t)
        update_block_hashes(request, 16)
    assert len(request.block_hashes) == 3  # 48 tokens now
    assert request.block_hashes[:2] == first  # earlier hashes untouched (hashed once)
    expected = hash_block_tokens(first[1], [*range(32, 40), *range(100, 108)])
    assert request.block_hashes[2] == expected


def test_chain_makes_equal_blocks_after_different_prefixes_differ() -> None:
    a = make_request("a", [1] * 16 + [7] * 16)
    b = make_request("b", [2] * 16 + [7] * 16)
    assert a.block_hashes[1] != b.block_hashes[1]
    c = make_request("c", [1] * 16 + [7] * 16 + [9])
    assert c.block_hashes == a.block_hashes


def test_extra_keys_isolate_tenants_and_adapters() -> None:
    tokens = list(range(32))
    plain = make_request("p", tokens)
    salted = make_request("s", tokens, cache_salt="tenant-1")
    salted2 = make_request("s2", tokens, cache_salt="tenant-2")
    lora = make_request("l", tokens, lora_id=3)
    same_salt = make_request("s3", tokens, cache_salt="tenant-1")
    hashes = [plain.block_hashes, salted.block_hashes, salted2.block_hashes, lora.block_hashes]
    for i, hi in enumerate(hashes):
        for hj in hashes[i + 1 :]:
            assert not set(hi) & set(hj)  # no block of one matches any block of another
    assert same_salt.block_hashes == salted.block_hashes


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.integers(0, 3), min_size=16, max_size=64),
    b=st.lists(st.integers(0, 3), min_size=16, max_size=64),
    salt_a=st.sampled_from([None, "x"]),
    salt_b=st.sampled_from([None, "x"]),
)
def test_hashes_equal_iff_prefixes_equal(
    a: list[int], b: list[int], salt_a: str | None, salt_b: str | None
) -> None:
    ra = make_request("a", a, cache_salt=salt_a)
    rb = make_request("b", b, cache_salt=salt_b)
    for i in range(min(len(ra.block_hashes), len(rb.block_hashes))):
        same_prefix = a[: 16 * (i + 1)] == b[: 16 * (i + 1)] and salt_a == salt_b
        assert (ra.block_hashes[i] == rb.block_hashes[i]) == same_prefix
