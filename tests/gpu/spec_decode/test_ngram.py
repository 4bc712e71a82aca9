"""The n-gram proposer (`vx.gpu.spec_decode.ngram`) and the draft check
(`vx.gpu.spec_decode.verifier`)."""

from __future__ import annotations

import numpy as np
import pytest

from vx.gpu.spec_decode.ngram import MIN_ACCEPTANCE, PROBE_DRAFTS, NgramProposer
from vx.gpu.spec_decode.verifier import num_accepted


def toks(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def test_proposes_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(k=4, min_n=2, max_n=5)
    assert p.propose("a", toks(1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3)) == [4, 5, 6, 7]
    # "1 2" occurs at 1 and 5: the later one; "9 1 2" nowhere, so n = 2 wins
    assert p.propose("a", toks(5, 1, 2, 9, 9, 1, 2, 3, 4, 7, 1, 2)) == [3, 4, 7, 1]
    # a longer match beats a later shorter one: "8 1 2" at 0-2 over "1 2" at 5-6
    assert p.propose("a", toks(8, 1, 2, 6, 9, 1, 2, 3, 8, 1, 2)) == [6, 9, 1, 2]
    # near the end: fewer than k tokens follow
    assert p.propose("a", toks(3, 1, 2, 7, 1, 2)) == [7, 1, 2]


def test_proposes_nothing_without_a_match_of_min_n() -> None:
    p = NgramProposer(k=3, min_n=3, max_n=4)
    assert p.propose("a", toks(1, 2, 3, 4, 2, 3)) == []  # "2 3" is only 2 long
    assert p.propose("a", toks(1, 2)) == []
    assert p.propose("a", toks(5, 6, 7, 8)) == []
    with pytest.raises(ValueError):
        NgramProposer(k=0, min_n=1, max_n=2)


def test_a_request_with_low_acceptance_stops_drafting() -> None:
    p = NgramProposer(k=4, min_n=2, max_n=5)
    t = toks(1, 2, 3, 4, 5, 1, 2)
    p.record("bad", PROBE_DRAFTS - 4, 0)
    assert p.propose("bad", t)  # not judged yet
    p.record("bad", 4, int(MIN_ACCEPTANCE * PROBE_DRAFTS) - 1)
    assert p.propose("bad", t) == []
    p.record("good", PROBE_DRAFTS, PROBE_DRAFTS)
    assert p.propose("good", t) == [3, 4, 5, 1]
    p.retire("bad")  # judged afresh (a preempted request resumes)
    assert p.propose("bad", t) == [3, 4, 5, 1]


def test_num_accepted_is_the_matching_prefix() -> None:
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4, 5, 6], [1, 5, 6, 7]) == 0
    assert num_accepted([], [3]) == 0
    with pytest.raises(ValueError):
        num_accepted([1, 2], [1, 2])
