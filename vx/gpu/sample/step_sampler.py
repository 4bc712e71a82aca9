"""StepSampler: a step's tokens (and logprobs) from its sampled rows' hidden states or logits.

Runs in: each Worker process, on the stage that samples (`ModelRunner.execute` calls it after
the forward).

The paths a step's tokens can take, chosen per step: the LM head's C argmax where every row is
greedy (`greedy_ids`, CPU); under a grammar, that argmax kept where the grammar allows it and
re-taken from the masked logits where it does not (`sample_constrained`); else the logits and
the `Sampler` (`sample`), which falls back to one row at a time when the batch raises, so that
a request whose parameters break the sampler fails alone. The fused greedy step
(`vx.gpu.sample.greedy.fused_greedy_step`) gives its tokens with the forward; `count_path`
counts every step under the path that gave its tokens.

Invariant: every path gives the tokens the full sampler gives for the same logits.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from vx.fault_injection import ENV as POISON_ENV, PoisonError, poison_seed
from vx.gpu.input_batch import InputBatch, RowTokens
from vx.gpu.sample.greedy import greedy_tokens
from vx.gpu.sample.sampler import Sampler, SamplingMetadata, compute_logprobs_rows
from vx.messages import SAMPLE_FAILED, Logprobs

if TYPE_CHECKING:
    from vx.gpu.sample.matchers import GrammarMatchers

logger = logging.getLogger(__name__)

__all__ = ["PATH_LABELS", "PROMPT_LOGPROBS_SLICE", "StepSampler", "join_logprobs"]

#: Prompt-logprob rows go through the LM head in slices of this many (a [rows, vocab] fp32
#: tensor for a whole 8K-token chunk would take gigabytes).
PROMPT_LOGPROBS_SLICE = 512
#: `StepSampler.path_steps`' keys, and how the first step of each is logged.
PATH_LABELS = {"fused": "fused greedy step", "argmax": "C argmax", "logits": "logits path"}


class StepSampler:
    """Samples a step's rows of one model over one persistent batch.

    `model` gives the logits (`compute_logits`) and the vocabulary size; `batch` the rows'
    sampling parameters and tokens; `matchers`, where set, the grammar state of the
    constrained requests.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batch: InputBatch,
        device: torch.device,
        matchers: GrammarMatchers | None = None,
    ) -> None:
        self.model = model
        self.batch = batch
        self.device = device
        self.matchers = matchers
        self.sampler = Sampler()
        #: Test-only (VX_TEST_POISON): requests with this seed make the sampler raise; a step
        #: with one of them in its batch leaves the fused step and the C argmax (`poisoned`).
        self.poison_seed = poison_seed("worker")
        #: Sampling steps by the path that gave their tokens: "fused" (`fused_greedy_step`: the
        #: layers, the final norm and the LM head's argmax in one C call), "argmax" (the model's
        #: forward, then the LM head's C argmax), "logits" (the logits and the sampler). The
        #: first step of each path is logged at INFO (`count_path`), so that a test can tell
        #: from a served tree's log that its steps took the default path.
        self.path_steps: dict[str, int] = dict.fromkeys(PATH_LABELS, 0)

    def count_path(self, path: str, rows: int) -> None:
        """Count a sampling step under `path` (`path_steps`); log the first of each path."""
        n = self.path_steps[path] = self.path_steps[path] + 1
        if n == 1:
            logger.info("tokens by the %s: first step, of %d row(s)", PATH_LABELS[path], rows)

    def poisoned(self, rows: np.ndarray) -> bool:
        """Test-only (VX_TEST_POISON): whether one of the batch rows `rows` carries the poisoned
        seed. Such a step leaves the fused step and the C argmax, so that the poisoned request
        reaches the sampler, where it raises (and fails alone); every other step keeps them.
        False at once where the variable is unset."""
        if self.poison_seed is None:
            return False
        params = self.batch.sampling_params
        return any(params[r].seed == self.poison_seed for r in rows.tolist())

    def greedy_ids(
        self, hidden: torch.Tensor, rows: np.ndarray, drafts: np.ndarray | None = None
    ) -> np.ndarray | None:
        """The tokens from the LM head's C argmax where every row is greedy (`vx.gpu.sample.greedy`);
        None where the logits path must run (not CPU, a poisoned row (`poisoned`), or a row
        that samples, asks for logprobs, biases or penalises)."""
        if self.device.type != "cpu" or self.poisoned(rows):
            return None
        return greedy_tokens(self.model, self.batch, hidden, rows, drafts)

    def sample_constrained(
        self,
        hidden: torch.Tensor,
        sampled: np.ndarray,
        rows: np.ndarray,
        sample_idx: np.ndarray,
        req_ids: list[str],
        num_reqs: int,
    ) -> np.ndarray:
        """A greedy step took its tokens from the LM head's argmax (fused step or C argmax):
        keep a constrained row's token where its grammar allows it, else re-take it from the
        row's masked logits, so every row keeps that fast path (`argmax_only` admits greedy
        constrained rows)."""
        matchers = self.matchers
        assert matchers is not None
        # Where the grammar allows the head's argmax, it is the masked argmax too: most steps
        # of a greedy constrained row form no logits at all.
        pos = [
            k for k, r in enumerate(req_ids)
            if matchers.is_constrained(r) and not matchers.allows(r, int(sampled[k]))
        ]  # fmt: skip
        if not pos:
            return sampled
        index = torch.tensor(pos, dtype=torch.long, device=hidden.device)
        logits = matchers.masked_logits(
            self.model, hidden.index_select(0, index), [req_ids[k] for k in pos]
        )
        tokens, _ = self.sample(logits, rows[pos], sample_idx[pos], num_reqs)
        sampled = np.array(sampled, dtype=np.int64, copy=True)
        sampled[pos] = tokens
        return sampled

    def sample(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        sample_idx: np.ndarray,
        num_reqs: int,
        drafts: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[Logprobs | None] | None]:
        """Sample the batch; if that raises, sample each row alone so that a request whose
        parameters break the sampler fails alone (token SAMPLE_FAILED) instead of killing the
        worker and every other request with it. A drafting request has a row per scored
        position (`sample_idx` repeats it; `drafts[j]`: the drafts before row j), and its
        Logprobs one row per position, in order."""
        try:
            return self._sample_rows(logits, rows, sample_idx, num_reqs, drafts)
        except Exception:
            if len(sample_idx) == 0:
                raise
            logger.exception("batched sampling failed; sampling each request alone")
        sampled = np.full(len(sample_idx), SAMPLE_FAILED, dtype=np.int64)
        merged: list[Logprobs | None] | None = None
        for j in range(len(sample_idx)):
            one = slice(j, j + 1)
            try:
                tok, lps = self._sample_rows(
                    logits[one], rows[one], sample_idx[one], num_reqs,
                    None if drafts is None else drafts[one],
                )  # fmt: skip
            except Exception as e:
                logger.error("request %s failed in sampling: %r", self._req_id_of(rows[j]), e)
                continue
            sampled[j] = tok[0]
            if lps is not None:
                i = int(sample_idx[j])
                merged = merged if merged is not None else [None] * num_reqs
                merged[i] = join_logprobs(merged[i], lps[i])
        return sampled, merged

    def _req_id_of(self, row: int) -> str:
        return next((r for r, i in self.batch.req_id_to_index.items() if i == row), "?")

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        sample_idx: np.ndarray,
        num_reqs: int,
        drafts: np.ndarray | None = None,
    ) -> tuple[np.ndarray, list[Logprobs | None] | None]:
        batch = self.batch
        row_list = rows.tolist()
        params = [batch.sampling_params[r] for r in row_list]
        if self.poison_seed is not None and any(p.seed == self.poison_seed for p in params):
            raise PoisonError(f"{POISON_ENV}: injected failure in the sampler")
        md = SamplingMetadata.build(
            params,
            prompt_token_ids=RowTokens(batch, rows, outputs=False),
            output_token_ids=RowTokens(batch, rows, outputs=True, drafts=drafts),
            eos_token_ids=[batch.eos_token_ids[r] for r in row_list],
            vocab_size=self.model.vocab_size,
            device=self.device,
        )
        if md.is_argmax_only and logits.device.type == "cpu":
            # NOTE: numpy's argmax over [64, 49152] fp32 on one thread is well ahead of
            # torch's (measured, torch 2.13 CPU); both return the first maximum.
            return np.argmax(logits.numpy(), axis=-1), None
        out = self.sampler(logits, md)
        sampled = out.sampled_token_ids.cpu().numpy()
        if out.logprobs is None:
            return sampled, None
        ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.ranks.tolist()
        result: list[Logprobs | None] = [None] * num_reqs
        for j, (i, p) in enumerate(zip(sample_idx.tolist(), params, strict=True)):
            if p.logprobs is not None:
                k = 1 + p.logprobs
                result[i] = join_logprobs(
                    result[i], Logprobs(token_ids=[ids[j][:k]], logprobs=[lps[j][:k]], ranks=[ranks[j]])
                )
        return sampled, result

    def wants_prompt_logprobs(self, rows: np.ndarray) -> bool:
        """Whether one of the batch rows `rows` asks for its prompt's logprobs."""
        wants = self.batch.wants_prompt_logprobs
        return any(wants[r] for r in rows.tolist())

    def prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        num_computed: np.ndarray,
        query_lens: np.ndarray,
        query_start: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, Logprobs] | None:
        """Logprobs of the prompt tokens this step's chunks predict (vLLM's prompt_logprobs).

        Request i of the step owns `hidden`'s rows [query_start[i], query_start[i] +
        query_lens[i]), positions num_computed[i] onwards. A chunk covering positions [s, e)
        yields rows for prompt tokens s+1 .. min(e, P-1): row p is the logprob of prompt token
        p+1 given tokens <= p, so the rows of all chunks together cover prompt tokens
        1 .. P-1 (token 0 has none). Positions served from the prefix cache are not
        recomputed and so get no row. Called only for steps with a request that wants them
        (`wants_prompt_logprobs`).
        """
        batch = self.batch
        wants = batch.wants_prompt_logprobs
        result: dict[str, Logprobs] = {}
        for i, row in enumerate(rows.tolist()):
            if not wants[row]:
                continue
            s = int(num_computed[i])
            e = min(s + int(query_lens[i]), int(batch.num_prompt_tokens[row]) - 1)
            if e <= s:
                continue
            k = batch.sampling_params[row].prompt_logprobs or 0
            start = int(query_start[i])
            ids_rows: list[list[int]] = []
            lp_rows: list[list[float]] = []
            rank_rows: list[int] = []
            for a in range(s, e, PROMPT_LOGPROBS_SLICE):
                b = min(a + PROMPT_LOGPROBS_SLICE, e)
                logits = self.model.compute_logits(hidden[start + a - s : start + b - s])
                targets = torch.from_numpy(batch.token_ids[row, a + 1 : b + 1].astype(np.int64))
                ids, lps, ranks = compute_logprobs_rows(logits, targets.to(self.device), k)
                ids_rows += ids.tolist()
                lp_rows += lps.tolist()
                rank_rows += ranks.tolist()
            result[req_ids[i]] = Logprobs(token_ids=ids_rows, logprobs=lp_rows, ranks=rank_rows)
        return result or None


def join_logprobs(a: Logprobs | None, b: Logprobs | None) -> Logprobs | None:
    """`a`'s positions then `b`'s (a drafting request's scored positions, in order)."""
    if a is None or b is None:
        return b if a is None else a
    return Logprobs(
        token_ids=a.token_ids + b.token_ids, logprobs=a.logprobs + b.logprobs, ranks=a.ranks + b.ranks
    )
