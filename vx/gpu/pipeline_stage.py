"""PipelineStage: one pipeline-parallel stage's part of a forward.

Runs in: each Worker process of a pipeline (`--pipeline-parallel-size` > 1); the ModelRunner
calls it in place of the model's whole forward.

A stage runs its own layers only, on the module path (neither the fused C step nor CUDA
graphs, which take the whole stack). The first stage embeds; every stage but the first
receives the previous one's hidden states and residual (`parallel_state.recv_from_prev`), and
every stage but the last sends its own on; the last stage returns the final hidden states,
which the ModelRunner samples from.

The hand-off (`parallel_state.hand_off_min_tokens`): in a step with at least that many prompt
tokens, each stage but the last stops its last layer after the attention and sends the
attention's output (width `hand_off_width`) and the residual instead; the next stage holds a
copy of that layer's o_proj, norm and MLP and finishes it before its own layers. Every stage
decides from the step's prompt-token count, which is the same on every stage, so sender and
receiver always agree on the shapes.
"""

from __future__ import annotations

import torch

from vx.gpu import parallel_state
from vx.gpu.attention.paged import AttentionMetadata


class PipelineStage:
    """This Worker's stage of `model` (built with the stage's layers only).

    Invariants: `hand_off_tokens` is None when the model cannot split its last layer
    (`hands_off_tails`), and then no step hands off; it is the same on every stage."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.dtype = dtype
        self.device = device
        self.grid = parallel_state.grid()
        #: the fewest prompt tokens of a step that hands each stage's last layer's o_proj,
        #: norm and MLP on to the next stage (None: never), and the width of the attention
        #: output a later stage then receives
        self.hand_off_tokens: int | None = None
        self.hand_off_width = 0
        hands_off = getattr(model, "hands_off_tails", None)
        if hands_off is not None and hands_off():
            self.hand_off_tokens = parallel_state.hand_off_min_tokens()
            inner = model.model
            if inner.tail_layer is not None:
                self.hand_off_width = inner.layers[inner.tail_layer].self_attn.q_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        attn_metadata: AttentionMetadata,
        keep: torch.Tensor | None,
        num_prompt_tokens: int,
        *,
        profile: bool = False,
    ) -> torch.Tensor | None:
        """The final hidden states on the last stage (rows `keep` only, if given); None on the
        others, which send theirs on. With `profile` (the start-up's memory profile) nothing
        is sent or received: a later stage runs on zeros. `num_prompt_tokens`: the step's
        tokens in rows of more than one (every stage counts the same), which decide the
        hand-off."""
        inner = self.model.model
        g = self.grid
        residual = None
        hand_off = self.hand_off_tokens is not None and num_prompt_tokens >= self.hand_off_tokens
        finish_prev = hand_off and not g.is_first_stage
        hand_off = hand_off and not g.is_last_stage
        if g.is_first_stage:
            x, rope = inner.embed(input_ids, positions)
        else:
            rope = inner.rope(positions)
            t = input_ids.shape[0]
            shape = (t, self.model.args.hidden_size)
            width = self.hand_off_width if finish_prev else shape[1]
            if profile:
                x = torch.zeros((t, width), dtype=self.dtype, device=self.device)
                residual = torch.zeros(shape, dtype=self.dtype, device=self.device)
            else:
                x, residual = parallel_state.recv_from_prev(
                    [(t, width), shape], self.dtype, self.device
                )
        if not g.is_last_stage:
            x, residual = inner.run_layers(x, rope, kv_caches, attn_metadata, None, residual,
                                           finish_prev=finish_prev, hand_off=hand_off)  # fmt: skip
            if not profile:
                parallel_state.send_to_next([x, residual])
            return None
        x, residual = inner.run_layers(x, rope, kv_caches, attn_metadata, keep, residual,
                                       finish_prev=finish_prev)  # fmt: skip
        return inner.final_norm(x, residual)
