"""Greedy tokens straight from the LM head's C argmax, without the [rows, vocab] logits.

Runs in: each Worker process on CPU (`StepSampler.greedy_ids`; `fused_greedy_step` before
the model's forward, for decode steps it can take whole).

Why: where every sampled row is one argmax (see `argmax_only`) and the model's LM head takes
it in C (AMX, the VNNI GEMM without AMX, or the int8 screen on AVX2), writing, widening and
re-reading the logits (6 MB at 64 rows) and torch's argmax over them are skipped.

Rows short of min_tokens (EOS and their stop ids at -inf) take it too. Invariant: the tokens
are the full sampler's. Where a row's plain argmax is not one of its masked ids it is also the
masked argmax (it is the first maximum, so no earlier id ties it, and masking only removes
candidates); where it is, the step forms the logits as the logits path forms them (the whole
batch, so the GEMM's route and sums are the same) and masks those rows as the sampler does.
Why: a benchmark's `min_tokens` = `max_tokens` otherwise sent every served step to the full
sampler (logits, widening, torch's argmax), a measurable share of the Worker's time at
c = 64 on a 2-core Zen 5.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vx.gpu.input_batch import InputBatch, RowTokens
from vx.gpu.sample.metadata import argmax_only, min_tokens_masked

if TYPE_CHECKING:
    from vx.gpu.cpu.fused_step import FusedDecode

__all__ = ["fused_greedy_step", "greedy_tokens"]

#: Whether `fused_greedy_step` is tried (tests set it False to compare with the sampler's path).
FUSED_STEP = True


def greedy_tokens(
    model: Any,
    batch: InputBatch,
    hidden: torch.Tensor,
    rows: np.ndarray,
    drafts: np.ndarray | None = None,
) -> np.ndarray | None:
    """[len(rows)] int64 tokens for the sampled rows' `hidden` states, or None where the logits
    path must run (a row that samples, asks for logprobs, biases or penalises; no C argmax).
    `drafts[j]`: the draft tokens before row j (speculative decoding), which count as outputs
    for min_tokens."""
    greedy_ids = getattr(model, "greedy_ids", None)
    if greedy_ids is None:
        return None
    params = _argmax_params(batch, rows, drafts)
    if params is None:
        return None
    ids = greedy_ids(hidden)
    if ids is None:
        return None
    return _unmask(model, batch, hidden, rows, params, ids, drafts)


def fused_greedy_step(
    fused: FusedDecode | None, model: Any, batch: InputBatch, inputs: Any, kv_caches: list
) -> tuple[torch.Tensor, np.ndarray | None] | None:
    """A decode-only step whose every row is sampled and greedy, through the layers, the final
    norm and the LM head's argmax in one C call (`fused`, the model's fused CPU step:
    `FusedDecode.greedy_decode` with `model.lm_head`; None: never taken): (final
    hidden states, [T] int64 tokens, or None where the head's int8 screen gave none: the
    caller forms the logits from the states), or None with nothing written (the caller runs
    the model and `greedy_tokens`, which give the same). Why: at 64 rows on a 2-core Zen 5
    the step otherwise opened four parallel regions (embedding, step, norm, head), and a host
    process waking at the step's start kept the second thread out of each in turn; at one
    row, the Python around the C calls left the second core idle."""
    t = inputs.input_ids.shape[0]
    if not FUSED_STEP or fused is None or len(inputs.sample_idx) != t:
        return None
    # before the rows' params: steps it would decline stop here
    if len(inputs.req_ids) != t or not fused.greedy_decode_takes(model.lm_head, t):
        return None
    params = _argmax_params(batch, inputs.rows)
    if params is None:
        return None
    md = inputs.attn_metadata
    done = fused.greedy_decode(model.lm_head, inputs.input_ids, inputs.positions, kv_caches, md)
    if done is None:
        return None
    hidden, ids = done
    if ids is None:  # the layers ran; the head's screen gave no token: the logits path
        return hidden, None
    return hidden, _unmask(model, batch, hidden, inputs.rows, params, ids)


def _argmax_params(
    batch: InputBatch, rows: np.ndarray, drafts: np.ndarray | None = None
) -> list | None:
    """The rows' sampling params where each row is one argmax (`argmax_only`), else None."""
    params = [batch.sampling_params[r] for r in rows.tolist()]
    outputs = RowTokens(batch, rows, outputs=True, drafts=drafts)
    if not argmax_only(params, outputs, masked_ok=True):
        return None
    return params


def _unmask(
    model: Any,
    batch: InputBatch,
    hidden: torch.Tensor,
    rows: np.ndarray,
    params: list,
    ids: np.ndarray,
    drafts: np.ndarray | None = None,
) -> np.ndarray:
    """`ids`, with the rows whose argmax is one of their min_tokens-masked ids taken from the
    logits as the sampler masks them (see the module docstring)."""
    row_list = rows.tolist()
    redo: list[tuple[int, list[int]]] = []
    for j, p in enumerate(params):
        if p.min_tokens > 0:
            row = row_list[j]
            n_out = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])
            if drafts is not None:
                n_out += int(drafts[j])
            masked = min_tokens_masked(p, n_out, batch.eos_token_ids[row], model.vocab_size)
            if int(ids[j]) in masked:
                redo.append((j, sorted(masked)))
    if redo:
        ids, js = np.array(ids, dtype=np.int64), [j for j, _ in redo]
        logits = model.compute_logits(hidden)[js]
        for k, (_, masked) in enumerate(redo):
            logits[k, masked] = float("-inf")
        ids[js] = np.argmax(logits.numpy(), axis=-1)
    return ids
