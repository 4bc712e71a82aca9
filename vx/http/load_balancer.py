"""Which EngineCore (data-parallel rank) a new request goes to: queue depth and prefix affinity.

Runs in: the ApiServer, inside `EngineClient.add_request` (synchronous, no I/O).

The score of an engine is vLLM's (its DP load balancer): 4 x waiting + running. The front
knows each engine's unfinished requests exactly (`in_flight`: waiting, running, or on their way
to it) and its waiting count from the engine's last step report, so the score is
``in_flight + 3 x waiting``. A request goes to the lowest score (the lowest rank on a tie),
unless an engine holds a prefix of its prompt: then it goes there while that engine's score is
within `slack` of the lowest, so requests that share a system prompt or a conversation meet
the KV blocks the first one left (vLLM's internal balancer has no affinity; routers in front
of replicas, llm-d's and SGLang's, weigh it against load the same way).

The affinity index is the front's own: a bounded LRU map from the key of each of a prompt's
first `max_blocks` full blocks (a chain, so a key names the whole prefix up to that block,
salted by the request's cache salt and LoRA id as the engine's block hashes are) to the engine
it was last sent to. It does not see evictions: a stale entry costs one request a prefix miss
on an engine that was within the slack anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from vx.config import BLOCK_SIZE

__all__ = ["LoadBalancer"]


class LoadBalancer:
    """Invariant: `pick` returns an index below `num_engines`; the index holds at most
    `max_entries` keys."""

    def __init__(
        self,
        num_engines: int,
        *,
        block_size: int = BLOCK_SIZE,
        max_blocks: int = 32,
        max_entries: int = 1 << 16,
        slack: int = 4,
    ) -> None:
        self.num_engines = num_engines
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_entries = max_entries
        #: How much higher than the lowest score an engine holding the prefix may be and
        #: still get the request (in requests: 4 running, or 1 waiting and 1 running).
        self.slack = slack
        self._owner: OrderedDict[int, int] = OrderedDict()

    def prefix_keys(self, prompt_token_ids: Sequence[int], salt: object = None) -> list[int]:
        """The chained key of each full block of the prompt's head, first block first."""
        bs = self.block_size
        n = min(len(prompt_token_ids) // bs, self.max_blocks)
        keys = []
        key = hash(("vx prefix", salt))
        for i in range(n):
            key = hash((key, tuple(prompt_token_ids[i * bs : (i + 1) * bs])))
            keys.append(key)
        return keys

    def pick(
        self,
        prompt_token_ids: Sequence[int],
        in_flight: Sequence[int],
        waiting: Sequence[int],
        salt: object = None,
    ) -> int:
        """The engine for a request with this prompt, given each engine's unfinished requests
        in the front and its last reported waiting count; remembers the choice."""
        if self.num_engines == 1:
            return 0
        scores = [n + 3 * w for n, w in zip(in_flight, waiting, strict=True)]
        best = min(range(self.num_engines), key=scores.__getitem__)
        keys = self.prefix_keys(prompt_token_ids, salt)
        owner = self._owner
        for key in reversed(keys):  # the longest prefix an engine holds
            engine = owner.get(key)
            if engine is not None:
                if scores[engine] <= scores[best] + self.slack:
                    best = engine
                break
        for key in keys:
            owner[key] = best
            owner.move_to_end(key)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)
        return best
