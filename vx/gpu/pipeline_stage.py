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

The shift (`parallel_state.shift_layers`): on a step that hands off, the boundary also moves
back whole layers. A stage stops n layers earlier, the next stage holds those n layers whole
(its shadow layers, with KV caches of their own) and runs them, and the tail copy is of the
layer before them. Both copies of the shadow layers' K/V are kept alike, every slot with the
K/V of the last step that wrote it:

- on a step that does not hand off, the earlier stage runs them and sends their K/V of the
  step's tokens with its hidden states; the next stage writes them before its own layers;
- on a step that hands off, the next stage runs them and sends their K/V back
  (`send_to_prev`). The earlier stage posts the receive right after its send of that step
  (so both stages post their p2p ops between them in one order, which NCCL needs:
  `parallel_state.irecv_from_next`), and writes them in step order before each step: those of
  every step but the one before at once (with PP = 2 the EngineCore scheduled this step only
  after their results came back, and the next stage sends before it returns; with more stages
  those of the step two before may still be on their way, and this stage then waits for the
  next one to finish that step, which it has usually done), and those of the step before
  only when this step runs the shadow layers over blocks it wrote (the step before is usually
  still running there: a request is never in two steps in flight, so it rarely must wait).
  So no step of this stage writes a slot of a step whose K/V it has not yet received, and
  the K/V received are never older than the slot's.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from vx.config import BLOCK_SIZE
from vx.gpu import parallel_state
from vx.gpu.attention.paged import AttentionMetadata
from vx.gpu.kv_cache import KVCache


@dataclasses.dataclass
class _Returning:
    """The K/V the next stage computed for this stage's shadowed layers in one step that
    handed off, not yet received."""

    step: int
    #: [T] int64 the step's slots, and the blocks they lie in
    slots: torch.Tensor
    blocks: torch.Tensor
    #: the receive of the K/V, posted right after the step's send on (`irecv_from_next`)
    handles: list


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
        inner = model.model
        if hands_off is not None and hands_off():
            self.hand_off_tokens = parallel_state.hand_off_min_tokens()
            if inner.tail_layer is not None:
                self.hand_off_width = inner.layers[inner.tail_layer].self_attn.q_size
        #: the previous stage's last layers held here (`kv_caches[:shadows]`), and this
        #: stage's last layers the next stage holds (`kv_caches[-shadowed:]`)
        self.shadows: int = getattr(inner, "shadow_layers", 0)
        self.shadowed: int = getattr(inner, "shadowed_layers", 0)
        #: steps run (their order: the EngineCore's)
        self.num_steps = 0
        #: the steps that handed off whose K/V of the shadowed layers have not yet been
        #: received from the next stage, oldest first
        self.returning: collections.deque[_Returning] = collections.deque()

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
        slots = attn_metadata.slot_mapping
        talk = not profile
        if talk and self.returning:
            self._receive_returns(kv_caches, attn_metadata, runs_shadowed=not hand_off)
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
                shapes = [(t, width), shape]
                if self.shadows and not finish_prev:  # the shadow layers' K/V come along
                    shapes.append(self._kv_shape(kv_caches, self.shadows, t))
                x, residual, *kv = parallel_state.recv_from_prev(shapes, self.dtype, self.device)
                if kv:
                    _write_rows(kv_caches[: self.shadows], slots, kv[0])
        x, residual = inner.run_layers(x, rope, kv_caches, attn_metadata,
                                       keep if g.is_last_stage else None, residual,
                                       finish_prev=finish_prev, hand_off=hand_off)  # fmt: skip
        if talk and finish_prev and self.shadows:
            parallel_state.send_to_prev([_read_rows(kv_caches[: self.shadows], slots)])
        step = self.num_steps
        if talk:
            self.num_steps += 1
        if g.is_last_stage:
            return inner.final_norm(x, residual)
        if talk:
            out = [x, residual]
            returns = self.shadowed and hand_off
            if self.shadowed and not hand_off:
                out.append(_read_rows(kv_caches[len(kv_caches) - self.shadowed :], slots))
            parallel_state.send_to_next(out)
            if returns:
                # Posted now, after this step's send and before the next step's: the next
                # stage sends them back between its receive of this step and of the next
                # (NCCL runs both directions' ops in one order; `irecv_from_next`).
                shape = self._kv_shape(kv_caches, self.shadowed, slots.shape[0])
                handles = parallel_state.irecv_from_next([shape], self.dtype, self.device)
                blocks = torch.unique(slots // BLOCK_SIZE)
                # a copy: the step's slot mapping may be a view of the runner's buffers
                self.returning.append(_Returning(step, slots.clone(), blocks, handles))
        return None

    def _kv_shape(self, kv_caches: list[KVCache], n: int, t: int) -> tuple[int, ...]:
        hkv, _, _, d = kv_caches[0][0].shape
        return (n, 2, hkv, t, d)

    def _receive_returns(
        self, kv_caches: list[KVCache], md: AttentionMetadata, *, runs_shadowed: bool
    ) -> None:
        """Take the next stage's K/V of the shadowed layers that this step may read, in step
        order: every earlier step's but the one before, and that one's too when this step runs
        the shadowed layers (`runs_shadowed`) over blocks it wrote."""
        caches = kv_caches[len(kv_caches) - self.shadowed :]
        while self.returning:
            r = self.returning[0]
            if r.step == self.num_steps - 1 and not (runs_shadowed and _reads(md, r.blocks)):
                return
            self.returning.popleft()
            [kv] = parallel_state.wait_recv(r.handles)
            _write_rows(caches, r.slots, kv)


def _reads(md: AttentionMetadata, blocks: torch.Tensor) -> bool:
    """Whether a step of `md` reads (or writes) any of `blocks`."""
    table = md.block_table
    used = torch.arange(table.shape[1], device=table.device) * BLOCK_SIZE < md.seq_lens[:, None]
    return bool(torch.isin(table[used], blocks.to(table.dtype)).any())


def _read_rows(caches: list[KVCache], slots: torch.Tensor) -> torch.Tensor:
    """[L, 2, Hkv, T, D]: each cache's K and V at `slots`."""
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    return torch.stack([torch.stack([k[:, blocks, offsets], v[:, blocks, offsets]])
                        for k, v in caches])  # fmt: skip


def _write_rows(caches: list[KVCache], slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Store `_read_rows`' [L, 2, Hkv, T, D] at `slots` of each cache."""
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    for (k, v), (k_rows, v_rows) in zip(caches, kv, strict=True):
        k[:, blocks, offsets] = k_rows
        v[:, blocks, offsets] = v_rows
