"""Draft-model drafts: a small model with the target's vocabulary proposes k greedy tokens for
each request, batched across the step's requests.

Runs in: every Worker process, after the target's sampling (`ModelRunner.execute`); its
forwards are collective under tensor parallelism, and rank 0's drafts are the step's.

KV: the draft model has KV tensors of its own over the target's block ids (the pool's blocks,
then one scratch block per batch row). A step first runs the draft over the very positions the
target computed in it (``[num_computed, computed after its rejected drafts)``, the same prompt
chunks), so wherever the target's KV is valid the draft's is too, prefix hits included; the
same pass takes each drafting request's newest token, whose logits give its first draft. Then
k - 1 one-row passes each feed a request's latest draft and take the next. The newest token and
the drafts may lie past the blocks the scheduler holds for the request (it holds blocks for the
tokens it scheduled): those positions go to the row's scratch block, one past its last, since
they are needed within this call only (the next step recomputes them from the target's
computed count). k <= 16 keeps them within one block.

Attention routing follows the target's: prompt tokens one prefill chunk, output tokens a decode
row each (`--batch-invariant`; every token a decode row where the target runs so in fp32), so a
draft equal to the target gives the target's logits there, and each greedy draft holds.

Drafts are the draft model's argmax (EOS masked while short of min_tokens, as the target's): q
is one-hot, and the verifier's acceptance is exact rejection sampling
(`vx.gpu.spec_decode.verifier`). A request with a grammar drafts within it: draft j is the
argmax over the tokens its grammar allows after drafts[:j] (`GrammarMatchers.mask_logits`,
which walks the drafts and rolls back), so its drafts are ones the target may accept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vx.config import BLOCK_SIZE
from vx.gpu.attention.paged import AttentionMetadata, build_attention_metadata
from vx.gpu.kv_cache import KVCache, allocate_kv_caches, block_bytes
from vx.gpu.sample.greedy import greedy_tokens
from vx.gpu.sample.metadata import min_tokens_masked
from vx.gpu.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from vx.gpu.input_batch import InputBatch
    from vx.gpu.sample.matchers import GrammarMatchers

__all__ = ["DraftModelProposer"]


class DraftModelProposer(Proposer):
    """Invariants: after `propose_batch`, the draft's KV of every position a request's target
    KV holds is the draft model's own for the same tokens; at most `k` drafts a request, none
    past `max_model_len`, none for a failed sample."""

    def __init__(
        self,
        model: Any,
        k: int,
        *,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
        batch_invariant: bool,
        tokens_as_decodes: bool,
        matchers: GrammarMatchers | None = None,
    ) -> None:
        super().__init__()
        #: the target's grammar state (after each step's emitted tokens, when drafts are made)
        self.matchers = matchers
        if not 1 <= k <= BLOCK_SIZE:
            raise ValueError(f"num_speculative_tokens must be in [1, {BLOCK_SIZE}], got {k}")
        if model.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.vocab_size}) is not the target's "
                f"({vocab_size})"
            )
        from vx.gpu.cpu.fused_step import FusedDecode

        self.model, self.k = model, k
        self.max_model_len = max_model_len
        self.device = device
        self.batch_invariant = batch_invariant
        self.tokens_as_decodes = tokens_as_decodes
        self.dtype = next(model.parameters()).dtype
        fused = FusedDecode.build(model.model, batch_invariant=batch_invariant)
        #: the draft's fused C step where it built (CPU, bf16), as the target's: its forward,
        #: and the one-row passes' layers and LM head argmax in one call
        self.fused = fused
        self.forward: Callable[..., torch.Tensor] = model if fused is None else fused.forward
        self.kv_caches: list[KVCache] = []
        self.num_blocks = 0

    def block_bytes(self) -> int:
        """Bytes one KV block of the draft takes (the pool's sizing adds it to the target's)."""
        m = self.model
        return block_bytes(m.num_layers, m.num_kv_heads, m.head_dim, self.dtype)

    def initialize_kv_cache(self, num_blocks: int, num_rows: int) -> None:
        """The pool's `num_blocks`, then a scratch block for each of `num_rows` batch rows."""
        m = self.model
        self.kv_caches = allocate_kv_caches(
            m.num_layers, num_blocks + num_rows, m.num_kv_heads, m.head_dim,
            dtype=self.dtype, device=self.device,
        )  # fmt: skip
        self.num_blocks = num_blocks

    # ───────────────────────── one step ─────────────────────────

    def propose_batch(
        self,
        batch: InputBatch,
        req_ids: list[str],
        rows: np.ndarray,
        sampled: list[list[int]],
        num_computed: np.ndarray | None = None,
    ) -> dict[str, list[int]]:
        """Catch the draft's KV up with this step (`num_computed[i]`: request i's computed
        count before it; `batch` holds the counts after it) and draft for each request that
        sampled (`sampled[i]`), by request id."""
        assert num_computed is not None
        rows = np.asarray(rows, dtype=np.int64)
        start = np.asarray(num_computed, dtype=np.int64)
        end = batch.num_computed_tokens[rows].astype(np.int64)
        drafting = np.zeros(len(rows), dtype=bool)
        for i, toks in enumerate(sampled):
            drafting[i] = bool(toks) and toks[0] >= 0 and self.may_draft(req_ids[i])
        # the newest token (the last known one) is fed too: the first draft follows it
        end = end + drafting
        num = np.where(drafting, np.minimum(self.k, self.max_model_len - end), 0)
        drafting &= num > 0
        if not drafting.any() and not np.any(end > start):
            return {}
        tables = self._tables(batch, rows, end + num)
        ids = self._catch_up(batch, rows, start, end, drafting, tables)
        d = np.flatnonzero(drafting)
        drafts = np.zeros((len(rows), self.k), dtype=np.int64)
        drafts[d, 0] = ids
        for j in range(1, self.k):
            d = d[num[d] > j]
            if not d.size:
                break
            pos = end[d] + j - 1  # the position of draft j (0-based: j - 1), fed now
            drafts[d, j] = self._decode_pass(
                batch, rows[d], drafts[d, j - 1], pos, tables[d], j, drafts[d, :j]
            )
        return {
            req_ids[i]: drafts[i, : int(num[i])].tolist() for i in np.flatnonzero(drafting)
        }

    def _tables(self, batch: InputBatch, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """[R, W] the rows' block tables over positions below `ends`, the row's scratch block
        past its held blocks."""
        width = max(-(-int(ends.max()) // BLOCK_SIZE), 1)
        have = min(width, batch.block_table.shape[1])
        tables = np.zeros((len(rows), width), dtype=np.int64)
        tables[:, :have] = batch.block_table[rows, :have]
        past = np.arange(width)[None, :] >= batch.num_blocks[rows][:, None]
        scratch = self.num_blocks + rows
        return np.where(past, scratch[:, None], tables)

    def _catch_up(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        start: np.ndarray,
        end: np.ndarray,
        drafting: np.ndarray,
        tables: np.ndarray,
    ) -> np.ndarray:
        """Run the draft over each request's positions ``[start, end)``; the first drafts of
        the `drafting` requests (from their last position's logits)."""
        prompt = batch.num_prompt_tokens[rows].astype(np.int64)
        # pieces: (request index, first position, length); decode rows first
        decodes: list[tuple[int, int]] = []
        chunks: list[tuple[int, int, int]] = []
        for i in np.flatnonzero(end > start).tolist():
            s, e, p = int(start[i]), int(end[i]), int(prompt[i])
            if self.tokens_as_decodes:
                decodes += [(i, q) for q in range(s, e)]
            elif not self.batch_invariant:  # one chunk, as the target schedules it
                if e - s == 1:
                    decodes.append((i, s))
                else:
                    chunks.append((i, s, e - s))
            else:  # the prompt part one chunk, each output token a decode row
                if s < p:
                    chunks.append((i, s, min(e, p) - s))
                decodes += [(i, q) for q in range(max(s, p), e)]
        req = np.array([i for i, _ in decodes] + [i for i, _, _ in chunks], dtype=np.int64)
        first = np.array([q for _, q in decodes] + [s for _, s, _ in chunks], dtype=np.int64)
        lens = np.array([1] * len(decodes) + [n for _, _, n in chunks], dtype=np.int64)
        tok_piece = np.repeat(np.arange(len(req)), lens)
        cu = np.cumsum(lens)
        positions = np.arange(int(cu[-1])) - (cu - lens)[tok_piece] + first[tok_piece]
        tok_req = req[tok_piece]
        input_ids = batch.token_ids[rows[tok_req], positions].astype(np.int64)
        md = self._metadata(lens, first, tables[req], tables[tok_req], positions, len(decodes))
        # the token whose logits give each drafting request's first draft: its last position
        d = np.flatnonzero(drafting)
        at_end = positions == end[tok_req] - 1
        last = np.zeros(len(rows), dtype=np.int64)
        last[tok_req[at_end]] = np.flatnonzero(at_end)
        # nobody drafts (a step of prefill chunks): one row past the attention, unused
        hidden = self._forward(input_ids, positions, md, last[d] if d.size else last[:1])
        return self._argmax(batch, rows[d], hidden[: d.size], 0)

    def _decode_pass(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        input_ids: np.ndarray,
        positions: np.ndarray,
        tables: np.ndarray,
        j: int,
        before: np.ndarray,
    ) -> np.ndarray:
        """Feed each row's draft `j - 1` at `positions` (a decode row each); draft j
        (`before[i]`: row i's drafts so far)."""
        ones = np.ones(len(rows), dtype=np.int64)
        md = self._metadata(ones, positions, tables, tables, positions, len(rows))
        fused, head = self.fused, getattr(self.model, "lm_head", None)
        if fused is not None and head is not None and fused.greedy_decode_takes(head, len(rows)):
            # the layers and the head's argmax in one C call (the module path's bits)
            ids_t = torch.from_numpy(input_ids).to(self.device)
            pos_t = torch.from_numpy(positions).to(self.device)
            done = fused.greedy_decode(head, ids_t, pos_t, self.kv_caches, md)
            if done is not None:
                hidden, ids = done
                if (
                    ids is not None
                    and not self._short_of_min_tokens(batch, rows, j)
                    and not self._constrained(batch, rows)
                ):
                    return np.asarray(ids, dtype=np.int64)
                return self._argmax(batch, rows, hidden, j, before)
        hidden = self._forward(input_ids, positions, md, None)
        return self._argmax(batch, rows, hidden, j, before)

    def _constrained(self, batch: InputBatch, rows: np.ndarray) -> list[int]:
        """The indices of `rows` whose request follows a grammar."""
        m = self.matchers
        if m is None or not m.num_active:
            return []
        return [i for i, r in enumerate(rows.tolist()) if m.is_constrained(batch.req_ids[r])]

    @staticmethod
    def _short_of_min_tokens(batch: InputBatch, rows: np.ndarray, num_drafts: int) -> bool:
        """Whether a row has fewer than its min_tokens outputs before this draft."""
        n_out = batch.num_tokens[rows] - batch.num_prompt_tokens[rows] + num_drafts
        pairs = zip(rows.tolist(), n_out.tolist(), strict=True)
        return any(batch.sampling_params[r].min_tokens > n for r, n in pairs)

    def _metadata(
        self,
        query_lens: np.ndarray,
        num_computed: np.ndarray,
        tables: np.ndarray,
        tok_tables: np.ndarray,
        positions: np.ndarray,
        num_decodes: int,
    ) -> AttentionMetadata:
        blocks = tok_tables[np.arange(len(positions)), positions // BLOCK_SIZE]
        return build_attention_metadata(
            query_lens=query_lens,
            num_computed=num_computed,
            block_table=tables,
            slot_mapping=blocks * BLOCK_SIZE + positions % BLOCK_SIZE,
            num_decodes=num_decodes,
            device=self.device,
        )

    def _forward(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        md: AttentionMetadata,
        keep: np.ndarray | None,
    ) -> torch.Tensor:
        """The draft's final hidden states at `keep` (None: every token)."""
        ids = torch.from_numpy(input_ids).to(self.device)
        pos = torch.from_numpy(positions).to(self.device)
        kept = None
        if keep is not None and keep.size < ids.shape[0]:  # the last layer on those rows
            kept = torch.from_numpy(keep).to(self.device)
        hidden = self.forward(ids, pos, self.kv_caches, md, kept)
        if keep is not None and kept is None:  # every token, in `keep`'s order
            hidden = hidden[torch.from_numpy(keep).to(self.device)]
        return hidden

    def _argmax(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        hidden: torch.Tensor,
        num_drafts: int,
        drafts: np.ndarray | None = None,
    ) -> np.ndarray:
        """The draft model's greedy token for each row, `num_drafts` drafts past its known
        tokens (`drafts[i]`, row i's): the target's C argmax where it takes the rows and none
        has a grammar, else the logits' argmax with the ids min_tokens masks and those its
        grammar forbids after the drafts at -inf."""
        if not rows.size:
            return np.zeros(0, dtype=np.int64)
        constrained = self._constrained(batch, rows)
        before = np.full(len(rows), num_drafts, dtype=np.int64)
        if self.device.type == "cpu" and not constrained:
            ids = greedy_tokens(self.model, batch, hidden, rows, before)
            if ids is not None:
                return np.asarray(ids, dtype=np.int64)
        logits = self.model.compute_logits(hidden).float()
        if constrained:
            self._mask_grammar(logits, batch, rows, constrained, drafts)
        for j, row in enumerate(rows.tolist()):
            p = batch.sampling_params[row]
            if p.min_tokens:
                n_out = int(batch.num_tokens[row] - batch.num_prompt_tokens[row]) + num_drafts
                masked = min_tokens_masked(
                    p, n_out, batch.eos_token_ids[row], self.model.vocab_size
                )
                if masked:
                    logits[j, sorted(masked)] = float("-inf")
        return logits.argmax(dim=-1).cpu().numpy().astype(np.int64)

    def _mask_grammar(
        self,
        logits: torch.Tensor,
        batch: InputBatch,
        rows: np.ndarray,
        constrained: list[int],
        drafts: np.ndarray | None,
    ) -> None:
        """Mask row i (of `constrained`) of `logits` by the state its grammar reaches after
        `drafts[i]`: the matcher masks one row per draft position (the last is this one's)."""
        m = self.matchers
        assert m is not None
        for i in constrained:
            req_id = batch.req_ids[int(rows[i])]
            d = [] if drafts is None else drafts[i].tolist()
            block = logits[i : i + 1].repeat(len(d) + 1, 1)
            m.mask_logits(block, [req_id] * (len(d) + 1), {req_id: d} if d else None)
            logits[i] = block[-1]
