"""InputBatch: the Worker's persistent per-request rows, updated from each SchedulerOutput diff.

Runs in: each Worker process.

Every request the EngineCore has scheduled and not yet finished or preempted owns one row of
preallocated numpy arrays: its token ids (prompt, then outputs), token counts, computed count
and block table, plus its SamplingParams and EOS id. A `SchedulerOutput` only carries what
changed (new requests, new block ids, computed counts, finished/preempted ids), so the rows are
edited in place and never rebuilt. Sampled tokens are appended here by the ModelRunner right
after each step, which is what lets async scheduling send counts only: the worker already knows
every token it produced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np

from vx.config import BLOCK_SIZE
from vx.messages import CachedRequestData, NewRequestData, SchedulerOutput
from vx.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["InputBatch", "RowTokens"]


class InputBatch:
    """Rows ``[0, num_reqs)`` hold the live requests, densely packed.

    Invariants:
    - `req_ids[i]` owns row i and `req_id_to_index[req_ids[i]] == i`; rows at or past
      `num_reqs` hold stale data that is never read;
    - ``token_ids[i, :num_tokens[i]]`` are the known tokens (prompt then outputs), the outputs
      being ``token_ids[i, num_prompt_tokens[i]:num_tokens[i]]``; the KV of the first
      ``num_computed_tokens[i]`` of them is in the cache (as the EngineCore last said);
    - ``block_table[i, :num_blocks[i]]`` are the request's block ids, in order; with G
      KV-cache groups, ``block_tables[g]`` is group g's table (``block_tables[0]`` is
      `block_table`), every group covering the same `num_blocks[i]` positions;
    - removal moves the last row into the hole (O(row) copy), so rows stay dense and a step's
      batch order is stable across steps except for the moved row.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        num_groups: int = 1,
        *,
        speculative: bool = False,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        #: speculative decoding: steps score drafts, and `update` drops rejected ones' blocks
        self.speculative = speculative
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # +1 column: the token sampled at the very last position is kept although it is never
        # fed back (the engine stops the request there).
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [
            np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
            for _ in range(num_groups)
        ]
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.sampling_params: list[SamplingParams] = []
        self.eos_token_ids: list[int | None] = []
        #: False once prompt logprobs must not be produced (resumed after preemption).
        self.wants_prompt_logprobs: list[bool] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_index

    # ───────────────────────── diff application ─────────────────────────

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Remove finished and preempted requests, add new ones, update cached ones."""
        for req_id in scheduler_output.finished_req_ids:
            self.remove(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            self.remove(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self.add(new)
        self.update(scheduler_output.scheduled_cached_reqs)

    def add(self, new: NewRequestData) -> int:
        """Add a new (or resumed) request at the end; returns its row."""
        if new.req_id in self.req_id_to_index:
            # A resumed request whose preemption we did not hear about: start it afresh.
            self.remove(new.req_id)
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_reqs} requests in the batch")
        num_prompt = len(new.prompt_token_ids)
        num_tokens = num_prompt + len(new.output_token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {new.req_id}: {num_tokens} tokens exceed max_model_len "
                f"{self.max_model_len}"
            )
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        if new.output_token_ids:
            self.token_ids[row, num_prompt:num_tokens] = new.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        self.req_ids.append(new.req_id)
        self.req_id_to_index[new.req_id] = row
        self.sampling_params.append(new.sampling_params)
        self.eos_token_ids.append(new.eos_token_id)
        self.wants_prompt_logprobs.append(
            new.sampling_params.prompt_logprobs is not None and not new.output_token_ids
        )
        return row

    def update(self, cached: CachedRequestData) -> None:
        """Append new block ids and set the computed counts of requests already here.

        Speculative decoding (`speculative`): first each request's block table goes back to
        the blocks of its computed tokens (those past them held rejected drafts only, and the
        scheduler freed them by the same rule, `Scheduler.schedule`). The scheduler's computed
        count may run ahead of this batch's by the drafts rejected in the step before, whose
        output it had not seen (async scheduling): the lower count holds."""
        spec = self.speculative
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = self.req_id_to_index.get(req_id)
            if row is None:
                raise KeyError(f"cached request {req_id!r} is not in the batch")
            if spec:
                keep = -(-num_computed // BLOCK_SIZE)
                if self.num_blocks[row] > keep:
                    self.num_blocks[row] = keep
                own = int(self.num_computed_tokens[row])
                if own < num_computed:
                    num_computed = own
            if block_ids:
                self._append_blocks(row, block_ids)
            self.num_computed_tokens[row] = num_computed
        if cached.new_token_ids:
            self._append_known(cached)

    def _append_known(self, cached: CachedRequestData) -> None:
        """Pipeline parallel: append the tokens a stage that does not sample lacks (their
        list starts at max(num_computed, prompt length), `CachedRequestData.new_token_ids`)."""
        for req_id, num_computed, tokens in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids, strict=True
        ):
            if not tokens:
                continue
            row = self.req_id_to_index[req_id]
            start = max(num_computed, int(self.num_prompt_tokens[row]))
            extra = start + len(tokens) - int(self.num_tokens[row])
            if extra > 0:
                self.append_token_list(row, tokens[-extra:])

    def remove(self, req_id: str) -> bool:
        """Drop a request; the last row moves into its place. False if it was not here."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return False
        last = self.num_reqs - 1
        if row != last:
            self._move_row(last, row)
        self.req_ids.pop()
        self.sampling_params.pop()
        self.eos_token_ids.pop()
        self.wants_prompt_logprobs.pop()
        return True

    def _move_row(self, src: int, dst: int) -> None:
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = int(self.num_blocks[src])
        for table in self.block_tables:
            table[dst, :nb] = table[src, :nb]
        for arr in (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens,
            self.num_blocks,
        ):
            arr[dst] = arr[src]
        req_id = self.req_ids[src]
        self.req_ids[dst] = req_id
        self.req_id_to_index[req_id] = dst
        self.sampling_params[dst] = self.sampling_params[src]
        self.eos_token_ids[dst] = self.eos_token_ids[src]
        self.wants_prompt_logprobs[dst] = self.wants_prompt_logprobs[src]

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Append new ids (with G groups: each group's in turn, as many each; a -1, a block
        freed out of a window and never read, is kept as block 0)."""
        start = int(self.num_blocks[row])
        tables = self.block_tables
        if len(tables) > 1:
            n = len(block_ids) // len(tables)
            ids = np.maximum(np.asarray(block_ids, dtype=np.int32), 0).reshape(len(tables), n)
            end = start + n
            if end > self.max_num_blocks_per_req:
                raise ValueError(
                    f"request {self.req_ids[row] if row < self.num_reqs else '?'}: {end} "
                    f"blocks exceed {self.max_num_blocks_per_req} per request"
                )
            for table, group_ids in zip(tables, ids, strict=True):
                table[row, start:end] = group_ids
            self.num_blocks[row] = end
            return
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"request {self.req_ids[row] if row < self.num_reqs else '?'}: {end} blocks "
                f"exceed {self.max_num_blocks_per_req} per request"
            )
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    # ───────────────────────── after a step ─────────────────────────

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of `rows` (vectorised).

        A row already holding max_model_len + 1 tokens keeps its tokens: with async scheduling
        the engine may run one step past a request's length limit before it stops it, and
        that extra token is never used.
        """
        if rows.size == 0:
            return
        cols = self.num_tokens[rows]
        room = cols <= self.max_model_len
        if not room.all():
            rows, cols, token_ids = rows[room], cols[room], np.asarray(token_ids)[room]
        self.token_ids[rows, cols] = token_ids
        self.num_tokens[rows] = cols + 1

    def append_token_list(self, row: int, token_ids: Sequence[int]) -> None:
        """Append several tokens to `row` (a drafting request's accepted drafts and its own
        token), as many as fit (see `append_tokens`)."""
        col = int(self.num_tokens[row])
        n = min(len(token_ids), self.max_model_len + 1 - col)
        if n > 0:
            self.token_ids[row, col : col + n] = token_ids[:n]
            self.num_tokens[row] = col + n

    def write_drafts(self, row: int, draft_ids: Sequence[int]) -> None:
        """Write a request's drafts after its known tokens, where the step reads its input ids;
        they stay unknown (`num_tokens` is unchanged) until accepted."""
        col = int(self.num_tokens[row])
        if col + len(draft_ids) > self.max_model_len:
            raise ValueError(f"request {self.req_ids[row]}: drafts past max_model_len")
        self.token_ids[row, col : col + len(draft_ids)] = draft_ids

    # ───────────────────────── views ─────────────────────────

    def prompt_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_prompt_tokens[row]]

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]


class RowTokens(Sequence):
    """Lazy per-row token views of `rows` (outputs, or prompts) for `SamplingMetadata.build`
    and `vx.gpu.sample.greedy`: a row's tokens are read only when it needs them. With
    `drafts` (outputs only), row i's outputs run `drafts[i]` tokens past the known ones: the
    drafts before a verified position (`InputBatch.write_drafts`)."""

    def __init__(
        self, batch: InputBatch, rows: np.ndarray, outputs: bool, drafts: np.ndarray | None = None
    ) -> None:
        self._batch, self._rows, self._outputs, self._drafts = batch, rows, outputs, drafts

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):  # type: ignore[override]
        row = int(self._rows[i])
        b = self._batch
        if not self._outputs:
            return b.prompt_token_ids(row)
        if self._drafts is None:
            return b.output_token_ids(row)
        end = b.num_tokens[row] + self._drafts[i]
        return b.token_ids[row, b.num_prompt_tokens[row] : end]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self._rows)))
