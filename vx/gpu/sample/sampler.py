"""Sampler: one step's logits to token ids (and logprobs), vectorised over the whole batch.

Runs in each Worker process (vx/gpu), on the device of the logits; the model runner calls it
once per step with a `SamplingMetadata` built for the same rows.

The order of operations is vLLM's (`vllm/v1/sample/sampler.py`):
1. logprobs, when any row asks, of the *raw* logits (vLLM's default `raw_logprobs`: the model's
   own distribution, before penalties, bias or temperature);
2. min_tokens (EOS and stop ids to -inf), then logit_bias;
3. penalties: repetition (prompt + output tokens), frequency and presence (output tokens);
4. greedy rows take the argmax here (ties go to the lowest id, as `torch.argmax`);
5. temperature, then min-p, then top-k, then top-p (top-p over the top-k-renormalised
   distribution), each a per-row mask to -inf;
6. the exponential race: argmax(probs / q) with q ~ Exponential(1) picks token i with
   probability probs[i], needs no CPU sync (unlike `torch.multinomial`), and lets a seeded row
   draw its own q from its own generator, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vx.gpu.sample.metadata import SamplingMetadata, step_seed

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs_rows",
    "gather_logprobs",
    "step_seed",
]

#: On the CPU a full sort of [64, 49152] logits is costly (every row's whole vocabulary), so
#: top-p first looks for each row's nucleus among its top candidates (one `topk`) and sorts
#: only the rows where it is not there. Accelerators sort everything: a sort is cheap there
#: and the check would sync.
CPU_TOP_P_CANDIDATES = 256

_NEG_INF = float("-inf")


class SamplerOutput(NamedTuple):
    """The sampler's result for N rows, on the logits' device.

    `logprob_token_ids[i]` / `logprobs[i]` hold the sampled token first, then the top
    `max_num_logprobs` tokens in descending order; each row's caller keeps the first
    `1 + params.logprobs` entries. The three logprob fields are None when no row asked.
    """

    sampled_token_ids: torch.Tensor  # [N] long
    logprob_token_ids: torch.Tensor | None  # [N, 1 + max_k] long
    logprobs: torch.Tensor | None  # [N, 1 + max_k] float32
    ranks: torch.Tensor | None  # [N] long, 1-based rank of the sampled token


class Sampler:
    """Samples one token per row; holds no per-request state.

    Invariants: a row's result depends only on its own logits, its own settings and (for a
    seeded row) `step_seed(seed, num_output_tokens)`, never on the other rows; unseeded random
    rows draw from `generator` (the device's default generator when None).

    NOTE: the sampler may modify `logits` in place when they are float32 and contiguous (as
    vLLM's does); the model runner produces fresh logits every step.
    """

    def __init__(
        self,
        *,
        generator: torch.Generator | None = None,
        num_top_p_candidates: int | None = None,
    ) -> None:
        self.generator = generator
        # None: CPU_TOP_P_CANDIDATES on the CPU, a full sort elsewhere; 0: always a full sort.
        self.num_top_p_candidates = num_top_p_candidates
        # One generator per device, reseeded for each seeded row (reseeding is cheap; a
        # generator per request would have to be kept in step with preemption).
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.is_argmax_only:
            return SamplerOutput(logits.argmax(dim=-1), None, None, None)
        if logits.shape != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} for {metadata.num_rows} rows "
                f"of vocab {metadata.vocab_size}"
            )
        logits = logits.to(torch.float32).contiguous()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)

        flat = logits.view(-1)
        if metadata.min_tokens_index is not None:
            flat.index_fill_(0, metadata.min_tokens_index, _NEG_INF)
        if metadata.logit_bias_index is not None:
            flat.index_add_(0, metadata.logit_bias_index, metadata.logit_bias_values)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)

        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample_random(logits, metadata)
            if greedy is not None:
                sampled = torch.where(metadata.greedy_mask, greedy, sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        token_ids, logprobs, ranks = gather_logprobs(
            raw_logprobs, sampled, metadata.max_num_logprobs
        )
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, min-p, top-k/top-p and the exponential race; modifies `logits`."""
        logits.div_(metadata.temperature.unsqueeze(1))
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        if metadata.top_p is not None or metadata.top_k is not None:
            num_candidates = self.num_top_p_candidates
            if num_candidates is None:
                num_candidates = CPU_TOP_P_CANDIDATES if logits.device.type == "cpu" else 0
            apply_top_k_top_p(logits, metadata, num_candidates)
        probs = logits.softmax(dim=-1)
        return probs.div_(self._exponential_noise(probs, metadata)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """q ~ Exponential(1) per element, drawn as -log(U) with U ~ Uniform[0, 1).

        U = 0 gives q = inf, which only makes that token lose; q is never 0. -log(U) is used
        rather than `exponential_` because it was measured cheaper on the CPU.
        """
        num_rows, vocab_size = probs.shape
        if metadata.num_unseeded == num_rows:
            q = torch.empty_like(probs).uniform_(generator=self.generator)
        else:
            # Greedy rows get a harmless constant; their sample is discarded.
            q = torch.full_like(probs, 0.5)
            if metadata.unseeded_rows is not None:
                noise = torch.empty(
                    (metadata.num_unseeded, vocab_size), dtype=probs.dtype, device=probs.device
                ).uniform_(generator=self.generator)
                q.index_copy_(0, metadata.unseeded_rows, noise)
            generator = self._seeded_generator(probs.device)
            for row, seed in zip(metadata.seeded_rows, metadata.row_seeds, strict=True):
                generator.manual_seed(seed)
                q[row].uniform_(generator=generator)
        return q.log_().neg_()

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        generator = self._seeded_generators.get(device)
        if generator is None:
            generator = self._seeded_generators[device] = torch.Generator(device=device)
        return generator


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty (vLLM's / HF's definitions), in place.

    Repetition divides positive logits and multiplies negative ones of every token seen in the
    prompt or the output; frequency subtracts penalty x (output count); presence subtracts the
    penalty once for any token in the output. Only the seen tokens change, so after one dense
    count (`index_add_` into a zeroed [N * V] buffer) the work is gathers and one scatter over
    the seen occurrences, not passes over [N, V] (measured far cheaper on the CPU at batch 64).
    NOTE: an occurrence seen twice writes the same value twice, so duplicates are harmless.
    """
    num_rows, vocab_size = logits.shape
    flat = logits.view(-1)
    output_index = metadata.output_token_index
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=logits.device)
    counts.index_add_(0, output_index, torch.ones_like(output_index, dtype=torch.float32))
    index = output_index
    if metadata.prompt_token_index is not None:
        index = torch.cat((output_index, metadata.prompt_token_index))
    rows = index // vocab_size
    values = flat[index]
    seen_counts = counts[index]
    if metadata.repetition_penalties is not None:
        penalty = metadata.repetition_penalties[rows]
        values = torch.where(values > 0, values / penalty, values * penalty)
    if metadata.frequency_penalties is not None:
        values = values - metadata.frequency_penalties[rows] * seen_counts
    if metadata.presence_penalties is not None:
        values = values - metadata.presence_penalties[rows] * (seen_counts > 0)
    flat[index] = values
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens with prob < min_p x (the row's top prob), in log space (no softmax).

    p_i < min_p * p_max  <=>  l_i < l_max + log(min_p); min_p = 0 gives -inf, masking nothing.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, metadata: SamplingMetadata, num_candidates: int
) -> None:
    """Mask to -inf every token outside its row's top-k, then outside its top-p nucleus.

    The nucleus is the smallest set of top tokens whose mass reaches p: a token is kept when
    the mass ranked strictly above it is < p. Both masks are thresholds on logit values, so
    tokens tied with the last kept one are kept too. `num_candidates` > 0 looks for each
    nucleus among that many top tokens first and fully sorts only the rows where it is not.
    """
    vocab_size = logits.shape[1]
    top_k, top_p = metadata.top_k, metadata.top_p
    if top_p is None:
        values = logits.topk(metadata.max_top_k, dim=-1).values
        logits.masked_fill_(logits < _kth_largest(values, top_k, vocab_size), _NEG_INF)
        return

    num_candidates = max(num_candidates, metadata.max_top_k) if num_candidates > 0 else 0
    if 0 < num_candidates < vocab_size:
        values = logits.topk(num_candidates, dim=-1).values
    else:
        values = logits.sort(dim=-1, descending=True).values
    if top_k is not None:
        kth = _kth_largest(values, top_k, vocab_size)
        logits.masked_fill_(logits < kth, _NEG_INF)
        values.masked_fill_(values < kth, _NEG_INF)
    threshold, found = _top_p_threshold(logits, values, top_p)
    if values.shape[1] < vocab_size and not bool(found.all()):
        rows = (~found).nonzero().squeeze(1)
        sub_logits = logits.index_select(0, rows)
        sub_values = sub_logits.sort(dim=-1, descending=True).values
        threshold[rows] = _top_p_threshold(sub_logits, sub_values, top_p[rows])[0]
    logits.masked_fill_(logits < threshold.unsqueeze(1), _NEG_INF)


def _kth_largest(values: torch.Tensor, top_k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, 1]: each row's k-th largest logit, from its top values (descending); -inf when off."""
    index = top_k.clamp(max=values.shape[1]).sub(1).unsqueeze(1)
    kth = values.gather(1, index)
    return kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), _NEG_INF)


def _top_p_threshold(
    logits: torch.Tensor, values: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logit value of each row's last nucleus token, and whether `values` held it.

    `values` [N, K] are each row's K largest logits in descending order. Rows with p >= 1
    get -inf (nothing masked) and count as found.
    """
    probs = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp_()
    cumulative = probs.cumsum(dim=-1)
    mass_above = torch.cat((torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]), dim=1)
    num_kept = (mass_above < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
    threshold = values.gather(1, num_kept.clamp(min=1) - 1).squeeze(1)
    off = top_p >= 1.0
    threshold.masked_fill_(off, _NEG_INF)
    found = (cumulative[:, -1] >= top_p) | off
    return threshold, found


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From full-vocab logprobs [N, V]: (ids, logprobs) [N, 1 + k] and ranks [N].

    Column 0 is `token_ids`, then the top `num_logprobs` in descending order; the rank counts
    the tokens with a logprob >= the token's own (so 1 for the argmax, ties rank low, as vLLM).
    """
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    num_logprobs = min(num_logprobs, logprobs.shape[1])
    if num_logprobs == 0:
        return token_ids, token_logprobs, ranks
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return (
        torch.cat((token_ids, top_ids), dim=1),
        torch.cat((token_logprobs, top_logprobs), dim=1),
        ranks,
    )


def compute_logprobs_rows(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs of `token_ids[i]` under `logits[i]`, plus the top `num_logprobs` and ranks.

    For prompt logprobs: row i is the logits at position i and `token_ids[i]` the prompt token
    that follows it. Same layout as `gather_logprobs`.
    """
    return gather_logprobs(logits.to(torch.float32).log_softmax(dim=-1), token_ids, num_logprobs)
