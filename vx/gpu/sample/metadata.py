"""SamplingMetadata: one step's sampling settings for a Worker's batch, as flags and tensors.

Runs in each Worker process (vx/gpu). The model runner builds it every step from the rows that
sample this step and hands it to `vx.gpu.sample.sampler.Sampler`. Building it is on the hot path: a
batch of plain greedy rows (the common serving case) must cost a Python loop over the rows and
nothing else, so every tensor here is built only when some row needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from vx.sampling_params import GREEDY_EPSILON, SamplingParams

__all__ = ["SamplingMetadata", "step_seed"]

#: Temperatures in [GREEDY_EPSILON, MIN_TEMPERATURE) are raised to MIN_TEMPERATURE, as vLLM does:
#: dividing logits by 1e-5 overflows the softmax for no visible difference in the result.
MIN_TEMPERATURE = 1e-2

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, position: int) -> int:
    """The 64-bit seed of a seeded request's noise at output `position` (splitmix64 mixing).

    It depends only on the request's seed and on how many tokens it has output, so the token
    drawn is the same whatever else is in the batch and after a preemption recomputes the
    request. Stable across processes and Python versions (no `hash()`).
    """
    z = ((seed & _MASK64) ^ ((position + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingMetadata:
    """Sampling inputs for `num_rows` rows, row i being the i-th request that samples this step.

    Invariants:
    - every tensor is on the device of the logits it will be applied to, with one entry per row
      (per-row tensors) or flat indices `row * vocab_size + token_id` into a contiguous
      [num_rows, vocab_size] logits tensor (the `*_index` tensors, always in range);
    - a tensor is None exactly when no row needs it, so a None means "skip this stage";
    - `is_argmax_only` implies every other optional field is None: the step is one argmax;
    - greedy rows carry neutral values (temperature 1, no top-k/top-p/min-p, no seed) so the
      random path can run over the whole batch; `greedy_mask` picks their argmax back out.
    """

    num_rows: int
    vocab_size: int
    #: Every row is greedy and nothing changes the logits or asks for logprobs.
    is_argmax_only: bool = False
    all_greedy: bool = False
    all_random: bool = False
    #: [N] bool, True on greedy rows; only for a batch mixing greedy and random rows.
    greedy_mask: torch.Tensor | None = None
    #: [N] float32, already clamped to >= MIN_TEMPERATURE, 1.0 on greedy rows.
    temperature: torch.Tensor | None = None
    #: [N] long, `vocab_size` where off; None when no random row uses top-k.
    top_k: torch.Tensor | None = None
    #: The largest top-k in use (<= vocab_size); 0 when top_k is None.
    max_top_k: int = 0
    #: [N] float32, 1.0 where off (the sampler treats >= 1 as off).
    top_p: torch.Tensor | None = None
    #: [N] float32, 0.0 where off.
    min_p: torch.Tensor | None = None
    #: Random rows with a seed, and the per-step seed of each (see `step_seed`).
    seeded_rows: tuple[int, ...] = ()
    row_seeds: tuple[int, ...] = ()
    #: Random rows without a seed: they share one batch-level noise draw. `unseeded_rows` is
    #: set only when they are neither none nor all of the rows.
    num_unseeded: int = 0
    unseeded_rows: torch.Tensor | None = None
    #: [N] float32 each; None when no row uses that penalty.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    #: Output tokens of the rows with a penalty (one entry per occurrence); set iff any penalty.
    output_token_index: torch.Tensor | None = None
    #: Prompt tokens of the rows with a repetition penalty; set iff repetition_penalties is.
    prompt_token_index: torch.Tensor | None = None
    logit_bias_index: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    #: EOS and stop ids of rows still short of min_tokens: set to -inf.
    min_tokens_index: torch.Tensor | None = None
    #: max over rows of `SamplingParams.logprobs`; None when no row asks for logprobs.
    max_num_logprobs: int | None = None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_index is None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Build the metadata for one step; rows are in the order of `params`.

        `output_token_ids[i]` are the tokens row i has generated so far, not including the one
        being sampled now. Token ids outside [0, vocab_size) (e.g. async-scheduling
        placeholders) are ignored by the penalties, logit_bias and min_tokens.
        """
        num_rows = len(params)
        if argmax_only(params, output_token_ids):  # the fast path: no tensors
            return cls(
                num_rows=num_rows, vocab_size=vocab_size, is_argmax_only=True, all_greedy=True
            )
        return _build_full(
            cls, params, prompt_token_ids, output_token_ids, eos_token_ids, vocab_size, device
        )


def argmax_only(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    *,
    masked_ok: bool = False,
) -> bool:
    """Whether sampling these rows is one argmax of the raw logits: greedy, no logprobs, no
    logit_bias or penalties, min_tokens already reached (one pass over the rows). With
    `masked_ok`, rows still short of min_tokens count too: theirs is the argmax of the logits
    with `min_tokens_masked` ids at -inf (the caller handles those). A greedy row with a
    grammar counts too: the model runner masks its logits before this argmax, or re-takes its
    token from them after the LM head's own argmax (`StepSampler.sample_constrained`)."""
    for p, out in zip(params, output_token_ids, strict=True):
        if (
            p.temperature >= GREEDY_EPSILON
            or p.logprobs is not None
            or p.logit_bias
            or (not masked_ok and p.min_tokens > len(out))
            or p.presence_penalty
            or p.frequency_penalty
            or p.repetition_penalty != 1.0
        ):
            return False
    return True


def min_tokens_masked(
    p: SamplingParams, num_output: int, eos_token_id: int | None, vocab_size: int
) -> set[int]:
    """The ids the sampler sets to -inf for a row with `num_output` tokens so far: EOS and the
    stop ids while min_tokens is not reached (EOS even with ignore_eos, as vLLM does), else
    none."""
    if p.min_tokens <= num_output:
        return set()
    ids = set(p.stop_token_ids)
    if eos_token_id is not None:
        ids.add(eos_token_id)
    return {t for t in ids if 0 <= t < vocab_size}


def _build_full(
    cls: type[SamplingMetadata],
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int | None],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    num_rows = len(params)
    vocab = vocab_size
    # Columns of one packed [7, N] float32 tensor, so the per-row values cost one copy to the
    # device; top-k fits exactly in float32 for any vocabulary under 2**24.
    temps: list[float] = []
    top_ks: list[float] = []
    top_ps: list[float] = []
    min_ps: list[float] = []
    presence: list[float] = []
    frequency: list[float] = []
    repetition: list[float] = []
    num_greedy = 0
    max_top_k = 0
    use_top_p = use_min_p = use_presence = use_frequency = False
    seeded_rows: list[int] = []
    row_seeds: list[int] = []
    unseeded_rows: list[int] = []
    penalty_rows: list[int] = []
    repetition_rows: list[int] = []
    bias_index: list[int] = []
    bias_values: list[float] = []
    min_tokens_index: list[int] = []
    max_num_logprobs: int | None = None

    for i, p in enumerate(params):
        num_output = len(output_token_ids[i])
        if p.temperature < GREEDY_EPSILON:
            num_greedy += 1
            temps.append(1.0)
            top_ks.append(vocab)
            top_ps.append(1.0)
            min_ps.append(0.0)
        else:
            temps.append(max(p.temperature, MIN_TEMPERATURE))
            k = p.top_k if 0 < p.top_k < vocab else vocab
            top_ks.append(k)
            if k < vocab:
                max_top_k = max(max_top_k, k)
            top_ps.append(p.top_p)
            use_top_p |= p.top_p < 1.0
            min_ps.append(p.min_p)
            use_min_p |= p.min_p > 0.0
            if p.seed is not None:
                seeded_rows.append(i)
                row_seeds.append(step_seed(p.seed, num_output))
            else:
                unseeded_rows.append(i)
        presence.append(p.presence_penalty)
        frequency.append(p.frequency_penalty)
        repetition.append(p.repetition_penalty)
        use_presence |= p.presence_penalty != 0.0
        use_frequency |= p.frequency_penalty != 0.0
        if p.repetition_penalty != 1.0:
            repetition_rows.append(i)
            penalty_rows.append(i)
        elif p.presence_penalty or p.frequency_penalty:
            penalty_rows.append(i)
        if p.logit_bias:
            base = i * vocab
            for token_id, bias in p.logit_bias.items():
                if 0 <= token_id < vocab:
                    bias_index.append(base + token_id)
                    bias_values.append(bias)
        if p.min_tokens > num_output:
            base = i * vocab
            masked = min_tokens_masked(p, num_output, eos_token_ids[i], vocab)
            min_tokens_index.extend(base + t for t in sorted(masked))
        if p.logprobs is not None:
            max_num_logprobs = max(max_num_logprobs or 0, p.logprobs)

    packed = torch.tensor(
        [temps, top_ks, top_ps, min_ps, presence, frequency, repetition], dtype=torch.float32
    ).to(device, non_blocking=True)
    (t_temp, t_top_k, t_top_p, t_min_p, t_presence, t_frequency, t_repetition) = packed.unbind(0)
    all_greedy = num_greedy == num_rows
    all_random = num_greedy == 0
    greedy_mask = None
    if not all_greedy and not all_random:
        greedy_mask = torch.tensor([p.temperature < GREEDY_EPSILON for p in params])
        greedy_mask = greedy_mask.to(device, non_blocking=True)
    num_unseeded = len(unseeded_rows)
    unseeded_index = None
    if 0 < num_unseeded < num_rows:
        unseeded_index = torch.tensor(unseeded_rows, dtype=torch.long).to(device)

    output_index = prompt_index = None
    if penalty_rows:
        output_index = _flat_token_index(output_token_ids, penalty_rows, vocab, device)
    if repetition_rows:
        prompt_index = _flat_token_index(prompt_token_ids, repetition_rows, vocab, device)

    return cls(
        num_rows=num_rows,
        vocab_size=vocab,
        all_greedy=all_greedy,
        all_random=all_random,
        greedy_mask=greedy_mask,
        temperature=None if all_greedy else t_temp,
        top_k=None if all_greedy or max_top_k == 0 else t_top_k.long(),
        max_top_k=max_top_k,
        top_p=t_top_p if use_top_p else None,
        min_p=t_min_p if use_min_p else None,
        seeded_rows=tuple(seeded_rows),
        row_seeds=tuple(row_seeds),
        num_unseeded=num_unseeded,
        unseeded_rows=unseeded_index,
        presence_penalties=t_presence if use_presence else None,
        frequency_penalties=t_frequency if use_frequency else None,
        repetition_penalties=t_repetition if repetition_rows else None,
        output_token_index=output_index,
        prompt_token_index=prompt_index,
        logit_bias_index=_long_tensor(bias_index, device) if bias_index else None,
        logit_bias_values=(
            torch.tensor(bias_values, dtype=torch.float32).to(device) if bias_index else None
        ),
        min_tokens_index=_long_tensor(min_tokens_index, device) if min_tokens_index else None,
        max_num_logprobs=max_num_logprobs,
    )


def _long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _flat_token_index(
    token_ids: Sequence[Sequence[int]], rows: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Flat indices `row * vocab_size + token` of every in-range token of `rows`, vectorised.

    Rows may be lists (gathered by `np.fromiter`, a C loop with no per-token Python) or numpy
    arrays (concatenated); the row offsets and the range filter are array ops.
    """
    parts = [token_ids[row] for row in rows]
    lengths = [len(part) for part in parts]
    total = sum(lengths)
    if total == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    if all(isinstance(part, np.ndarray) for part in parts):
        tokens = np.concatenate(parts).astype(np.int64, copy=False)
    else:
        # NOTE: not `torch.frombuffer(array("q", ...))`: ops on such tensors were measured
        # far slower with 2 intra-op threads (torch 2.13, CPU).
        tokens = np.fromiter(chain.from_iterable(parts), dtype=np.int64, count=total)
    index = np.repeat(np.asarray(rows, dtype=np.int64) * vocab_size, lengths) + tokens
    valid = (tokens >= 0) & (tokens < vocab_size)
    if not valid.all():
        index = index[valid]
    return torch.from_numpy(index).to(device, non_blocking=True)
