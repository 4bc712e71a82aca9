"""Shared fixtures for the Worker-side tests: tiny models and a paged-cache driver.

Runs in: the test process.

`PagedDriver` plays the ModelRunner's part for model tests: it hands out KV blocks (shuffled,
so block tables are not contiguous), orders each step decodes-first as `vx.gpu.attention.paged`
requires, builds the real `AttentionMetadata` and runs the forward the ModelRunner would run (the
fused CPU step's `forward` where it builds, else the model's) + `compute_logits`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.models import make_tiny_model
from vx.config import BLOCK_SIZE
from vx.gpu.attention.paged import build_attention_metadata
from vx.gpu.cpu import vnni as cpu_vnni
from vx.gpu.cpu.fused_step import FusedDecode
from vx.gpu.cpu.library import load_cpu_kernels
from vx.gpu.kv_cache import allocate_kv_caches


class PagedDriver:
    """Runs a model over a paged KV cache for several requests, one step at a time.

    `step({req_id: new_token_ids})` appends the tokens of each request (a prefill chunk or one
    decode token), runs one flat forward over all of them and returns {req_id: float32 logits
    [vocab] of its last new token}. `forward`: the forward to run (`model` itself: the module
    path); by default the one the ModelRunner picks at load (`FusedDecode.build`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int = 256,
        seed: int = 0,
        forward: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        if forward is None:
            fused = FusedDecode.build(model.model)
            forward = model if fused is None else fused.forward
        self.forward = forward
        dtype = next(model.parameters()).dtype
        self.kv_caches = allocate_kv_caches(
            model.num_layers, num_blocks, model.num_kv_heads, model.head_dim,
            dtype=dtype, device="cpu",
        )  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    @torch.no_grad()
    def step(self, batch: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one step; {req_id: float32 logits [vocab] after its last new token}."""
        return {r: x[-1] for r, x in self.step_all(batch).items()}

    @torch.no_grad()
    def step_all(
        self, batch: dict[str, list[int]], keep_last: bool = False
    ) -> dict[str, torch.Tensor]:
        """Run one step; {req_id: float32 logits [n_new, vocab] after each new token}, or,
        with `keep_last`, [1, vocab] after its last one (the model is asked for those rows
        only, as the ModelRunner asks)."""
        # decodes (one new token) first, as the attention metadata requires
        order = sorted(batch, key=lambda r: len(batch[r]) != 1)
        num_decodes = sum(len(batch[r]) == 1 for r in order)
        ids, positions, slots, query_lens, computed, tables = [], [], [], [], [], []
        for req_id in order:
            tokens = batch[req_id]
            blocks = self.blocks.setdefault(req_id, [])
            start = self.lens.get(req_id, 0)
            end = start + len(tokens)
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [
                blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            query_lens.append(len(tokens))
            computed.append(start)
            tables.append(blocks)
            self.lens[req_id] = end
        width = max(len(t) for t in tables)
        md = build_attention_metadata(
            query_lens=np.array(query_lens),
            num_computed=np.array(computed),
            block_table=np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32),
            slot_mapping=np.array(slots),
            num_decodes=num_decodes,
        )
        keep = torch.tensor(np.cumsum(query_lens) - 1) if keep_last else None
        hidden = self.forward(
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            self.kv_caches,
            md,
            keep,
        )
        logits = self.model.compute_logits(hidden)
        return dict(zip(order, logits.split([1] * len(order) if keep_last else query_lens), strict=True))

    def greedy(self, prompts: dict[str, list[int]], max_new_tokens: int) -> dict[str, list[int]]:
        """Prefill all prompts in one step, then decode them together."""
        logits = self.step(prompts)
        out = {r: [int(logits[r].argmax())] for r in prompts}
        for _ in range(max_new_tokens - 1):
            logits = self.step({r: [toks[-1]] for r, toks in out.items()})
            for r, x in logits.items():
                out[r].append(int(x.argmax()))
        return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One tiny random model dir per architecture, built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    archs = ("llama", "qwen2", "mistral")
    return {arch: make_tiny_model(root, arch, seed=i) for i, arch in enumerate(archs)}


@pytest.fixture()
def amx_vnni():
    """The CPU kernel library where the AMX VNNI GEMM is on (native AMX, or emulated), else
    the test is skipped."""
    lib = load_cpu_kernels()
    if lib is None or not lib.vx_has_gemm_amx_vnni() or cpu_vnni._amx_lib() is None:
        pytest.skip("no AMX here (native or emulated): the AMX VNNI GEMM is not on")
    return lib
