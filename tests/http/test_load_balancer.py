"""`LoadBalancer`: vLLM's queue-depth score, and prefix affinity within a slack."""

from __future__ import annotations

from vx.http.load_balancer import LoadBalancer

A = list(range(100, 164))  # four full blocks
B = list(range(200, 264))


def test_least_loaded_by_vllms_score() -> None:
    lb = LoadBalancer(3)
    assert lb.pick([1, 2], [2, 1, 1], [0, 0, 0]) == 1  # lowest score, lowest rank on a tie
    # 4 x waiting + running: engine 1's one waiting request outweighs engine 0's two running
    assert lb.pick([1, 2], [2, 2, 5], [0, 1, 0]) == 0


def test_same_prefix_follows_its_engine_when_loads_are_equal() -> None:
    lb = LoadBalancer(2)
    assert lb.pick(A, [0, 0], [0, 0]) == 0
    assert lb.pick(B, [1, 0], [0, 0]) == 1
    # idle again: a tie would pick 0, but B's prefix lives on 1
    assert lb.pick(B[:48] + [7] * 20, [0, 0], [0, 0]) == 1
    assert lb.pick(A[:20], [0, 0], [0, 0]) == 0
    # a different first block is another prefix, whatever follows
    assert lb.pick([9] * 16 + B[16:], [0, 0], [0, 0]) == 0
    # the cache salt separates tenants as the engine's hashes do
    assert lb.pick(B, [0, 0], [0, 0], salt=("tenant", None)) == 0


def test_a_loaded_engine_is_avoided_past_the_slack() -> None:
    lb = LoadBalancer(2, slack=4)
    assert lb.pick(A, [0, 0], [0, 0]) == 0
    assert [lb.pick(A, [n, 0], [0, 0]) for n in range(1, 6)] == [0, 0, 0, 0, 1]
    # the prefix now answers to engine 1, where it was sent last
    assert lb.pick(A, [0, 0], [0, 0]) == 1
    # waiting requests count four times
    assert lb.pick(A, [2, 3], [0, 3]) == 0  # scores 2 and 12


def test_one_engine_and_a_bounded_index() -> None:
    assert LoadBalancer(1).pick(A, [9], [9]) == 0
    lb = LoadBalancer(2, max_entries=8)
    for i in range(20):
        lb.pick([i] * 64, [0, 0], [0, 0])
    assert len(lb._owner) == 8
