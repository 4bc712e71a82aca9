"""The n-gram proposer (`vx.gpu.spec_decode.ngram`) and the draft check
(`vx.gpu.spec_decode.verifier`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vx.gpu.spec_decode.draft_length import DraftLength
from vx.gpu.spec_decode.ngram import NgramProposer
from vx.gpu.spec_decode.verifier import num_accepted


def toks(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def test_proposes_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(k=4, min_n=2, max_n=5)
    assert p.lookup(toks(1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3)) == [4, 5, 6, 7]
    # "1 2" occurs at 1 and 5: the later one; "9 1 2" nowhere, so n = 2 wins
    assert p.lookup(toks(5, 1, 2, 9, 9, 1, 2, 3, 4, 7, 1, 2)) == [3, 4, 7, 1]
    # a longer match beats a later shorter one: "8 1 2" at 0-2 over "1 2" at 5-6
    assert p.lookup(toks(8, 1, 2, 6, 9, 1, 2, 3, 8, 1, 2)) == [6, 9, 1, 2]
    # near the end: fewer than k tokens follow
    assert p.lookup(toks(3, 1, 2, 7, 1, 2)) == [7, 1, 2]


def test_proposes_nothing_without_a_match_of_min_n() -> None:
    p = NgramProposer(k=3, min_n=3, max_n=4)
    assert p.lookup(toks(1, 2, 3, 4, 2, 3)) == []  # "2 3" is only 2 long
    assert p.lookup(toks(1, 2)) == []
    assert p.lookup(toks(5, 6, 7, 8)) == []
    with pytest.raises(ValueError):
        NgramProposer(k=0, min_n=1, max_n=2)


def _settle(lengths: DraftLength, req_id: str, proposal: list[int], came: list[int]) -> None:
    """Watch `proposal` after a 3-token history, then let `came` be the tokens that followed."""
    history = [100, 101, 102]
    lengths.watch(req_id, len(history), proposal)
    known = np.array(history + came, dtype=np.int32)
    lengths.observe(req_id, known, len(known))


def test_draft_length_follows_each_requests_acceptance() -> None:
    lengths = DraftLength(4)
    assert lengths.length("new") == 4  # never seen: the prior drafts all of them
    for _ in range(10):  # the first draft holds, the second never
        _settle(lengths, "half", [1, 2, 3, 4], [1, 9, 9, 9])
        _settle(lengths, "bad", [1, 2, 3, 4], [9, 9, 9, 9])
        _settle(lengths, "good", [1, 2, 3, 4], [1, 2, 3, 4])
    assert lengths.length("half") == 1
    assert lengths.length("bad") == 0
    assert lengths.length("good") == 4
    # a request that drafts nothing still learns: its proposals now hold, it drafts again
    for _ in range(10):
        _settle(lengths, "bad", [1, 2, 3, 4], [1, 2, 3, 4])
    assert lengths.length("bad") == 4
    lengths.retire("half")  # judged afresh (a preempted request resumes)
    assert lengths.length("half") == 4


def test_a_proposal_is_settled_only_by_the_tokens_that_decide_it() -> None:
    lengths = DraftLength(4)
    lengths.watch("a", 3, [1, 2, 3, 4])
    lengths.watch("a", 4, [7, 7, 7, 7])  # one at a time: ignored
    assert lengths.watching("a")
    lengths.observe("a", np.array([100, 101, 102, 1, 2], dtype=np.int32), 5)
    assert lengths.watching("a")  # two held so far: undecided
    lengths.observe("a", np.array([100, 101, 102, 1, 2, 5], dtype=np.int32), 6)
    assert not lengths.watching("a")  # the third failed
    lengths.watch("a", 6, [])  # nothing proposed: nothing watched
    assert not lengths.watching("a")


def test_propose_batch_drafts_by_length_and_answers_every_drafting_request() -> None:
    p = NgramProposer(k=4, min_n=2, max_n=5)
    rows = [[1, 2, 3, 4, 5, 1, 2], [5, 6, 7, 8, 9, 10, 11]]  # a match; none
    batch = SimpleNamespace(
        token_ids=np.array([r + [0] * 57 for r in rows], dtype=np.int32),
        num_tokens=np.array([7, 7]),
    )
    out = p.propose_batch(batch, ["a", "b"], np.array([0, 1]), [[2], [11]])
    # "b" drafts (its length is above zero) but has nothing to draft now: listed, empty
    assert out == {"a": [3, 4, 5, 1], "b": []}
    # its proposals fail: "a" stops drafting, and is left out of the answer
    for i in range(12):
        n = int(batch.num_tokens[0])
        # the target's token is never the draft (a new one each time), then the n-gram
        # "1 2" comes back: a new proposal, of the token that followed it last time
        batch.token_ids[0, n : n + 3] = [200 + i, 1, 2]
        batch.num_tokens[0] = n + 3
        out = p.propose_batch(batch, ["a"], np.array([0]), [[2]])
    assert p.lengths.length("a") == 0 and out == {}
    # a failed sample drafts nothing
    assert p.propose_batch(batch, ["b"], np.array([1]), [[-1]]) == {}


def test_num_accepted_is_the_matching_prefix() -> None:
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4, 5, 6], [1, 5, 6, 7]) == 0
    assert num_accepted([], [3]) == 0
    with pytest.raises(ValueError):
        num_accepted([1, 2], [1, 2])
