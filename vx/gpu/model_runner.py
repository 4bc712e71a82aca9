"""ModelRunner: one SchedulerOutput in, one ModelRunnerOutput out.

Runs in: each Worker process (one per tensor-parallel rank; only rank 0's output is sent).

A step: apply the diff to the persistent `InputBatch`; flatten the scheduled tokens of every
request into one batch (decodes first, as `vx.gpu.attention.paged` requires) with numpy array ops
(no per-token Python); build the `AttentionMetadata` once; run the model (on CPU, through the
fused C step `load_model` chose, `fused_step`, where it built); compute logits only
at the last scheduled token of each request whose chunk reaches the end of its known tokens
(the others are mid-prefill and get an empty token list); sample
(`vx.gpu.sample.step_sampler`); append the sampled tokens to
the persistent rows (so the next step, even one scheduled before this output arrived, finds
them there); and answer with the tokens (and logprobs when asked).

Pipeline parallel: `vx.gpu.pipeline_stage` runs this stage's layers in place of the model's
forward (receiving from the stage before, sending to the next); the last stage samples as
above. The earlier stages learn the sampled tokens from the next SchedulerOutput
(`CachedRequestData.new_token_ids`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vx.config import BLOCK_SIZE, DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from vx.errors import KVCacheTooSmallError
from vx.gpu import parallel_state
from vx.gpu.attention.paged import AttentionMetadata, build_attention_metadata
from vx.gpu.input_batch import InputBatch
from vx.gpu.kv_cache import (
    KVCache,
    KVCacheGroups,
    allocate_kv_caches,
    block_bytes,
    kv_cache_groups,
    layer_caches,
    num_cpu_blocks,
    num_gpu_blocks,
)
from vx.gpu.pipeline_stage import PipelineStage
from vx.gpu.sample.greedy import fused_greedy_step
from vx.gpu.sample.step_sampler import StepSampler
from vx.gpu.spec_decode.draft_model import DraftModelProposer
from vx.gpu.spec_decode.ngram import NgramProposer
from vx.gpu.spec_decode.slots import DraftSlots
from vx.gpu.spec_decode.verifier import accept_drafts, roll_back
from vx.messages import Logprobs, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from vx.gpu.cpu.fused_step import FusedDecode
    from vx.gpu.sample.matchers import GrammarMatchers

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "StepInputs"]

@dataclass(eq=False)
class StepInputs:
    """One step's flattened batch. Request i of the step owns tokens
    ``[query_start[i], query_start[i] + query_lens[i])``; decodes come first."""

    req_ids: list[str]
    rows: np.ndarray  # [R] InputBatch rows
    query_lens: np.ndarray  # [R]
    query_start: np.ndarray  # [R]
    num_computed: np.ndarray  # [R] before this step
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_metadata: AttentionMetadata
    #: Indices into req_ids of the requests that sample this step.
    sample_idx: np.ndarray
    #: [R] each request's draft tokens scored this step (speculative decoding; its last
    #: 1 + num_drafts tokens are each sampled), or None when no request drafts.
    num_drafts: np.ndarray | None = None


class ModelRunner:
    """Owns the model, the KV caches, the persistent batch and the sampler of one rank.

    Invariants: `load_model` runs before `determine_num_blocks`, which runs before
    `initialize_kv_cache`, which runs before any `execute`; `execute` is called with the
    SchedulerOutputs in step order, each exactly once.
    """

    def __init__(self, config: EngineConfig, *, rank: int = 0, device: str = "cpu") -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(device)
        #: this Worker's pipeline stage (`vx.gpu.parallel_state.init` ran before)
        self.grid = parallel_state.grid()
        self.pp_size = self.grid.pp_size
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model: torch.nn.Module | None = None
        #: one (K, V) per layer of this stage (`GroupKVCache`s over shared slots where the
        #: model has several KV-cache groups, `vx.gpu.kv_cache.kv_cache_groups`)
        self.kv_caches: list[KVCache] = []
        #: the layers' KV-cache groups (`load_model`); one group unless layers differ
        self.kv_groups: KVCacheGroups | None = None
        self.num_blocks = 0
        self.max_model_len = config.model.max_model_len or 0
        self.input_batch: InputBatch | None = None
        #: Pipeline parallel: this stage's part of a forward (`load_model`); None: one stage.
        self.stage: PipelineStage | None = None
        #: The step's sampling (`vx.gpu.sample.step_sampler`), built by `load_model`.
        self.sampling: StepSampler | None = None
        #: The grammar state of the constrained requests (`vx.gpu.sample.matchers`).
        self.matchers: GrammarMatchers | None = None
        #: Captured decode graphs (vx.gpu.cuda_graphs); None: every step runs eagerly.
        self.cuda_graphs = None
        #: The fused CPU step (vx.gpu.cpu.fused_step), chosen once by `load_model` once the
        #: weights are final: its `forward` stands in for the model's, and its greedy decode
        #: step for the forward and the head's argmax. None (GPU, not bf16, no C kernels,
        #: `VX_CPU_DECODE_STEP=0`): the model's own forward runs every step.
        self.fused_step: FusedDecode | None = None
        #: every token a decode row of the attention (batch-invariant fp32; `load_model`)
        self.tokens_as_decodes = False
        #: speculative decoding's draft proposer (n-gram: rank 0 drafts; a draft model: every
        #: rank runs it, rank 0's drafts count; every rank verifies). `load_model` loads a
        #: draft model.
        self.proposer: NgramProposer | DraftModelProposer | None = None
        sp = config.speculative
        #: async scheduling with drafts: the scheduler sends draft slots, and every rank fills
        #: them with its own proposals (`vx.gpu.spec_decode.slots`)
        self.draft_slots = (
            DraftSlots() if sp.enabled and config.scheduler.async_scheduling else None
        )
        if sp.method == "ngram":
            self.proposer = NgramProposer(
                sp.num_speculative_tokens, sp.prompt_lookup_min, sp.prompt_lookup_max
            )

    # ───────────────────────── start-up ─────────────────────────

    def load_model(self) -> None:
        from vx.gpu.cpu.fused_step import FusedDecode
        from vx.gpu.layers.linear_method import set_batch_invariant

        m = self.config.model
        torch.manual_seed(m.seed)
        # Decided before the weights are processed: each linear's method chain follows it.
        set_batch_invariant(self.config.batch_invariant)
        self.model = self._load_weights(m.path)
        self.dtype = next(self.model.parameters()).dtype
        if self.pp_size > 1:
            self.stage = PipelineStage(self.model, self.dtype, self.device)
        # Batch-invariant fp32 (no C prefill attention for fp32; SDPA's arithmetic follows the
        # chunk and the cached prefix): every token is a decode row of the decode kernel, with
        # its own position as its length, so prompts, outputs and recomputes all take one
        # per-row arithmetic.
        self.tokens_as_decodes = (
            self.config.batch_invariant and self.device.type == "cpu" and self.dtype == torch.float32
        )
        # After the copies above are final: the C step's descriptions point at them.
        if self.pp_size == 1:  # the C step runs the whole stack
            self.fused_step = FusedDecode.build(
                self.model.model, batch_invariant=self.config.batch_invariant
            )
        limit = int(getattr(self.model, "max_position", 0) or 0)
        self.max_model_len = m.max_model_len or limit
        window = getattr(self.model, "sliding_window", None)
        if window and self.max_model_len > window:
            # A window on some layers only (Qwen2's max_window_layers) is not implemented:
            # stay where full attention is exact.
            logger.warning("max_model_len capped at the sliding window (%d)", window)
            self.max_model_len = window
        windows = getattr(self.model, "attention_windows", None) or (None,)
        if self.config.speculative.method == "draft_model":
            windows = (None,)  # a draft model reads the target's blocks: one group, all kept
        self.kv_groups = kv_cache_groups(windows)
        self.input_batch = InputBatch(
            self.config.scheduler.max_num_seqs,
            self.max_model_len,
            math.ceil(self.max_model_len / BLOCK_SIZE),
            self.kv_groups.num_groups,
            speculative=self.config.speculative.enabled,
        )
        from vx.gpu.sample.matchers import GrammarMatchers

        if self.grid.is_last_stage:  # the stage that samples
            self.matchers = GrammarMatchers(m.path, self.model.vocab_size)
        self.sampling = StepSampler(self.model, self.input_batch, self.device, self.matchers)
        sp = self.config.speculative
        if sp.method == "draft_model":
            assert sp.model is not None  # `EngineConfig.validate`
            self.proposer = DraftModelProposer(
                self._load_weights(sp.model),
                sp.num_speculative_tokens,
                vocab_size=self.model.vocab_size,
                max_model_len=self.max_model_len,
                device=self.device,
                batch_invariant=self.config.batch_invariant,
                tokens_as_decodes=self.tokens_as_decodes,
                matchers=self.matchers,
            )

    def _load_weights(self, path: str) -> torch.nn.Module:
        """Load a model (the target, or the draft model) and make its weights final for this
        device: collapsed into huge pages and GEMM plans tuned on CPU."""
        from vx.gpu.cpu.pages import collapse_weights
        from vx.gpu.cpu.row_plan import tune as tune_row_plan, tune_vnni
        from vx.gpu.cpu.vnni import amx_vnni_rows
        from vx.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
        from vx.gpu.loader import load_model

        m = self.config.model
        model = load_model(
            path,
            dtype=m.dtype,
            device=self.device,
            tp_rank=self.rank,
            tp_size=self.config.parallel.tensor_parallel_size,
            pp_rank=self.grid.pp_rank,  # a draft model never (speculation refuses PP)
            pp_size=self.pp_size,
            progress=False,
            quantization=m.quantization,
        )
        if self.config.batch_invariant:
            _check_invariant_blocks(model)
        if self.device.type == "cpu":  # before the KV cache: only populated pages collapse
            collapse_weights(model)
            # the layers' linears only: the LM head takes one row a request
            linears = [mod for mod in model.modules()
                       if isinstance(mod, ColumnParallelLinear | RowParallelLinear)]  # fmt: skip
            tune_row_plan(
                [(mod.weight, mod.bias, *mod.weight.shape) for mod in linears if mod.packed]
            )
            last = amx_vnni_rows()[1]
            tune_vnni(
                [(mod.vnni, mod.vnni.n, mod.vnni.k, last) for mod in linears
                 if mod.packed and mod.vnni is not None and mod.vnni.amx]
            )  # fmt: skip
        return model

    def _num_kv_slots(self) -> int:
        """K/V tensor pairs this stage allocates: a layer each, or with several KV-cache
        groups the group size (`vx.gpu.kv_cache`)."""
        groups = self.kv_groups
        if groups is None or groups.num_groups == 1:
            return self._model.num_layers
        return groups.group_size

    def _block_bytes(self) -> int:
        m = self._model
        per_block = block_bytes(self._num_kv_slots(), m.num_kv_heads, m.head_dim, self.dtype)
        if isinstance(self.proposer, DraftModelProposer):  # its KV over the same block ids
            per_block += self.proposer.block_bytes()
        return per_block

    def determine_num_blocks(self) -> tuple[int, int]:
        """(num_blocks, kv_cache_bytes) for this rank's pool."""
        cache = self.config.cache
        per_block = self._block_bytes()
        if cache.num_blocks_override is not None:
            num = cache.num_blocks_override
        elif self.device.type == "cpu":
            budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            num = num_cpu_blocks(budget, per_block)
        else:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # Everything already in use (weights, CUDA context, other processes) counts as
            # "weights" for the pool: it is memory the pool cannot have.
            in_use = total - free
            peak = self.profile_run()
            num = num_gpu_blocks(total, cache.gpu_memory_utilization, in_use, peak, per_block)
            logger.info(
                "GPU memory: %.2f GiB total, %.2f GiB in use, %.2f GiB activation peak",
                total / 2**30, in_use / 2**30, peak / 2**30,
            )  # fmt: skip
        if num <= 0:
            raise KVCacheTooSmallError(
                f"no room for one KV cache block ({per_block} bytes) in the memory given; "
                "raise --kv-cache-memory (CPU) or --gpu-memory-utilization (GPU)"
            )
        return num, num * per_block

    def profile_run(self) -> int:
        """Run a forward of max_num_batched_tokens prefill tokens; returns the activation peak.

        The tokens all write one slot of a one-block cache and read block 0 (values are
        garbage but finite), so the profile needs no KV pool. Returns bytes on CUDA, 0 on CPU.
        """
        m = self._model
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        seq_len = max(min(self.max_model_len, num_tokens), 1)
        lens = [seq_len] * (num_tokens // seq_len)
        if num_tokens % seq_len:
            lens.append(num_tokens % seq_len)
        caches = allocate_kv_caches(
            m.num_layers, 1, m.num_kv_heads, m.head_dim, dtype=self.dtype, device=self.device
        )
        query_lens = np.array(lens)
        positions = np.concatenate([np.arange(n) for n in lens])
        md = build_attention_metadata(
            query_lens=query_lens,
            num_computed=np.zeros(len(lens), dtype=np.int64),
            block_table=np.zeros((len(lens), math.ceil(seq_len / BLOCK_SIZE)), np.int32),
            slot_mapping=np.zeros(num_tokens, dtype=np.int64),
            num_decodes=0,
            device=self.device,
        )
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            pos = torch.from_numpy(positions).to(self.device)
            if self.stage is None:
                hidden = m(ids, pos, caches, md, None)
            else:
                hidden = self.stage.forward(ids, pos, caches, md, None, num_tokens, profile=True)
            if hidden is not None:  # the last stage
                n = min(sched.max_num_seqs, num_tokens)
                m.compute_logits(hidden[:n]).argmax(dim=-1)
        del caches, hidden
        if not cuda:
            return 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return int(peak)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self._model
        slots = allocate_kv_caches(
            self._num_kv_slots(), num_blocks, m.num_kv_heads, m.head_dim, dtype=self.dtype,
            device=self.device,
        )  # fmt: skip
        assert self.kv_groups is not None
        inner = getattr(m, "model", m)
        start = getattr(inner, "cache_start", 0)
        self.kv_caches = layer_caches(slots, self.kv_groups, start, start + m.num_layers)
        self.num_blocks = num_blocks
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.initialize_kv_cache(num_blocks, self.config.scheduler.max_num_seqs)
        logger.info(
            "KV cache: %d blocks (%d tokens, %.2f GiB)",
            num_blocks, num_blocks * BLOCK_SIZE, num_blocks * self._block_bytes() / 2**30,
        )  # fmt: skip
        from vx.gpu.cuda_graphs import capture_cuda_graphs

        if self.pp_size == 1:  # a stage's forward receives and sends: eager
            self.cuda_graphs = capture_cuda_graphs(self)  # None on CPU or with enforce_eager

    @property
    def _model(self):
        if self.model is None:
            raise RuntimeError("load_model() has not run")
        return self.model

    # ───────────────────────── one step ─────────────────────────

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        so = scheduler_output
        batch = self.input_batch
        if batch is None or not self.kv_caches:
            raise RuntimeError("execute() before load_model() and initialize_kv_cache()")
        batch.apply(so)
        if self.proposer is not None:  # preempted ones are judged afresh when they resume
            for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
                self.proposer.retire(req_id)
                if self.draft_slots is not None:
                    self.draft_slots.drop(req_id)
        num_scored = None
        if self.draft_slots is not None and so.scheduled_spec_decode_tokens:
            so, num_scored = self.draft_slots.fill(so)
        matchers = self.matchers
        if matchers is not None and (matchers.num_active or so.scheduled_new_reqs):
            matchers.apply(so)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput(step_id=so.step_id, req_ids=[], sampled_token_ids=[])
        inputs = self.prepare_inputs(so)
        model = self._model
        sampling = self.sampling
        assert sampling is not None
        forward = model if self.cuda_graphs is None else self.cuda_graphs.forward
        if self.fused_step is not None:  # CPU only (`load_model`): never beside CUDA graphs
            forward = self.fused_step.forward
        sample_idx = inputs.sample_idx
        last = inputs.query_start[sample_idx] + inputs.query_lens[sample_idx] - 1
        drafts = None  # per sampled row: the drafts before it (speculative decoding)
        if inputs.num_drafts is not None:
            # a drafting request samples each of its last 1 + k rows: expand it to them
            counts = inputs.num_drafts[sample_idx] + 1
            first = np.cumsum(counts) - counts
            drafts = np.arange(int(counts.sum())) - np.repeat(first, counts)
            last = np.repeat(last - counts + 1, counts) + drafts
            sample_idx = np.repeat(sample_idx, counts)
        wants_prompt_logprobs = sampling.wants_prompt_logprobs(inputs.rows)
        # Only the sampled rows' hidden states are used, unless prompt logprobs need them
        # all: the last layer then runs past its attention on those rows alone.
        last_rows = torch.from_numpy(last).to(self.device)
        keep = None
        if not wants_prompt_logprobs and last.size < inputs.input_ids.shape[0]:
            keep = last_rows
        fused = None
        if (
            self.fused_step is not None
            and not wants_prompt_logprobs
            and drafts is None
            and not sampling.poisoned(inputs.rows)
        ):
            fused = fused_greedy_step(self.fused_step, model, batch, inputs, self.kv_caches)
        if fused is not None:  # a greedy decode step, its tokens included, in one C call
            hidden, sampled = fused
        elif self.stage is not None:
            ql = inputs.query_lens
            stage = self.stage.forward(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, keep,
                int(ql[ql > 1].sum()),
            )  # fmt: skip
            if stage is None:  # an earlier stage: the next one goes on with this step
                batch.num_computed_tokens[inputs.rows] = inputs.num_computed + inputs.query_lens
                return ModelRunnerOutput(
                    step_id=so.step_id, req_ids=[], sampled_token_ids=[],
                    execute_time_s=time.perf_counter() - t0,
                )  # fmt: skip
            hidden = stage
        else:
            hidden = forward(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, keep
            )

        num_reqs = len(inputs.req_ids)
        sampled_lists: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs_out: list[Logprobs | None] | None = None
        if sample_idx.size:
            hidden_last = hidden if keep is not None or fused is not None else hidden[last_rows]
            rows = inputs.rows[sample_idx]
            constrained = matchers is not None and matchers.num_active > 0
            spec = so.scheduled_spec_decode_tokens if drafts is not None else None
            if fused is None and not (constrained and spec):  # drafts: masks by position
                sampled = sampling.greedy_ids(hidden_last, rows, drafts)
            elif fused is None:
                sampled = None
            sampling.count_path(
                "logits" if sampled is None else "argmax" if fused is None else "fused", rows.size
            )
            if constrained:
                sample_req_ids = [inputs.req_ids[j] for j in sample_idx.tolist()]
            if sampled is None:
                logits = model.compute_logits(hidden_last)
                if constrained:  # before anything reads the logits (logprobs included)
                    matchers.mask_logits(logits, sample_req_ids, spec)
                sampled, logprobs_out = sampling.sample(logits, rows, sample_idx, num_reqs, drafts)
                if constrained and drafts is not None:  # a grammar's end, per draft position
                    sampled = matchers.end_masked_rows(sample_req_ids, sampled)
            elif constrained:
                sampled = sampling.sample_constrained(hidden_last, sampled, rows, sample_idx,
                                                      sample_req_ids, num_reqs)  # fmt: skip
            if constrained and drafts is None:
                sampled = matchers.end_where_stopped(sample_req_ids, sampled)
                matchers.accept(sample_req_ids, sampled.tolist())
            if drafts is None:
                # A request whose sampling failed reports -1 (SAMPLE_FAILED); its row gets a
                # harmless token until the EngineCore's finished_req_ids drops it.
                batch.append_tokens(rows, np.maximum(sampled, 0))
                for j, tok in zip(sample_idx.tolist(), sampled.tolist(), strict=True):
                    sampled_lists[j] = [tok]
            else:
                accept_drafts(
                    batch, inputs.req_ids, inputs.rows, so.scheduled_spec_decode_tokens,
                    sample_idx, sampled, sampled_lists, logprobs_out, self.proposer,
                )  # fmt: skip
                if constrained:  # the emitted tokens only: the rejected drafts never entered
                    matchers.accept_lists(inputs.req_ids, sampled_lists)
        # Requests advance by what was scheduled (the next diff sets the same value again),
        # less a drafting request's rejected drafts.
        computed = inputs.num_computed + inputs.query_lens
        if inputs.num_drafts is not None:
            roll_back(inputs.num_drafts, sampled_lists, computed)
        batch.num_computed_tokens[inputs.rows] = computed
        prompt_logprobs = None
        if wants_prompt_logprobs:
            prompt_logprobs = sampling.prompt_logprobs(
                inputs.req_ids, inputs.rows, inputs.num_computed, inputs.query_lens,
                inputs.query_start, hidden,
            )  # fmt: skip
        return ModelRunnerOutput(
            step_id=so.step_id,
            req_ids=inputs.req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs_out,
            prompt_logprobs=prompt_logprobs,
            execute_time_s=time.perf_counter() - t0,
            spec_token_ids=self._propose(inputs, sampled_lists),
            spec_num_scored=num_scored,
        )

    def _propose(
        self, inputs: StepInputs, sampled: list[list[int]]
    ) -> dict[str, list[int]] | None:
        """The next step's drafts, by request id (rank 0's go to the EngineCore, which
        schedules them; a draft model runs on every rank, its forwards being collective)."""
        proposer = self.proposer
        if proposer is None:
            return None
        slots = self.draft_slots
        if self.rank != 0 and slots is None and not isinstance(proposer, DraftModelProposer):
            return {}
        assert self.input_batch is not None
        drafts = proposer.propose_batch(
            self.input_batch, inputs.req_ids, inputs.rows, sampled, inputs.num_computed
        )
        if slots is not None:  # every rank keeps them: the next step's slots take them
            slots.keep(inputs.req_ids, sampled, drafts)
        return drafts if self.rank == 0 else {}

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled tokens (decodes first) and build the attention metadata."""
        batch = self.input_batch
        assert batch is not None
        index = batch.req_id_to_index
        decodes: list[str] = []
        drafting: list[str] = []
        prefills: list[str] = []
        spec = so.scheduled_spec_decode_tokens
        for req_id, n in so.num_scheduled_tokens.items():
            if spec and req_id in spec:
                drafting.append(req_id)
                continue
            # A prompt token takes the prefill attention even alone (the last one after a
            # prefix hit, a chunk of one), as it does cold: its bits do not depend on how
            # the prompt was cut (speculation moves the cuts; `--batch-invariant` too).
            outputs = req_id not in index or (
                batch.num_computed_tokens[index[req_id]] >= batch.num_prompt_tokens[index[req_id]]
            )
            if outputs and n > 1:  # recomputed outputs (the scheduler cut the prompt before)
                drafting.append(req_id)
                continue
            (decodes if outputs else prefills).append(req_id)
        # A drafting request's 1 + k tokens, and a run of recomputed output tokens, are each
        # a decode row of the attention (its position + 1 keys): the decode attention's
        # arithmetic, as without drafts and when they were first computed.
        req_ids = decodes + drafting + prefills
        num_reqs = len(req_ids)
        try:
            rows = np.fromiter((index[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        except KeyError as e:
            raise KeyError(f"scheduled request {e.args[0]!r} is not in the batch") from None
        nst = so.num_scheduled_tokens
        query_lens = np.fromiter((nst[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        num_computed = batch.num_computed_tokens[rows]
        ends = num_computed + query_lens
        known = batch.num_tokens[rows]
        if spec:
            known = known + np.fromiter(
                (len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=num_reqs
            )
        if np.any(ends > known):
            bad = req_ids[int(np.argmax(ends > known))]
            raise ValueError(f"request {bad!r} was scheduled past its known tokens")
        num_drafts = None
        if spec:  # each draft after its request's known tokens; they are inputs, not known
            num_drafts = known - batch.num_tokens[rows]
            for i in np.flatnonzero(num_drafts).tolist():
                batch.write_drafts(int(rows[i]), spec[req_ids[i]])
        cu = np.cumsum(query_lens)
        query_start = cu - query_lens
        num_tokens = int(cu[-1])
        tok_req = np.repeat(np.arange(num_reqs), query_lens)
        positions = np.arange(num_tokens) - query_start[tok_req] + num_computed[tok_req]
        tok_rows = rows[tok_req]
        input_ids = batch.token_ids[tok_rows, positions]
        block_idx = positions // BLOCK_SIZE
        if np.any(block_idx >= batch.num_blocks[tok_rows]):
            raise ValueError("a scheduled token has no KV block")
        offsets = positions % BLOCK_SIZE
        width = -(-int(ends.max()) // BLOCK_SIZE)
        # each token of the first d requests a decode row of its own (all of them with
        # `tokens_as_decodes`, `load_model`), then the prefill chunks
        d = num_reqs if self.tokens_as_decodes else len(decodes) + len(drafting)
        as_rows = self.tokens_as_decodes or bool(drafting)
        t = int(cu[d - 1]) if d and as_rows else 0
        # per KV-cache group its table's rows and slots (one group: `block_table` alone); a
        # layer reads its group's metadata (`AttentionMetadata.for_cache`)
        tables = []
        for table in batch.block_tables:
            slot_mapping = table[tok_rows, block_idx].astype(np.int64) * BLOCK_SIZE + offsets
            if as_rows:
                rows_table = np.concatenate([table[tok_rows[:t], :width], table[rows[d:], :width]])
            else:
                rows_table = table[rows, :width]
            tables.append((rows_table, slot_mapping))
        if as_rows:
            md = build_attention_metadata(
                query_lens=np.concatenate([np.ones(t, dtype=np.int64), query_lens[d:]]),
                num_computed=np.concatenate([positions[:t], num_computed[d:]]),
                block_table=tables[0][0],
                slot_mapping=tables[0][1],
                num_decodes=t,
                device=self.device,
                group_tables=tables[1:],
            )
        else:
            md = build_attention_metadata(
                query_lens=query_lens,
                num_computed=num_computed,
                block_table=tables[0][0],
                slot_mapping=tables[0][1],
                num_decodes=len(decodes),
                device=self.device,
                group_tables=tables[1:],
            )
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            query_lens=query_lens,
            query_start=query_start,
            num_computed=num_computed,
            input_ids=torch.from_numpy(input_ids.astype(np.int64)).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            attn_metadata=md,
            sample_idx=np.flatnonzero(ends == known),
            num_drafts=num_drafts,
        )


def _check_invariant_blocks(model) -> None:
    """`--batch-invariant` covers the Llama decoder block (Llama, Mistral, Qwen2): its linears
    take the invariant chain and its attention the paged kernels. Other families' experts,
    windows or soft-caps run torch's kernels, whose sums follow the batch: refused."""
    from vx.gpu.attention.paged import paged_attention
    from vx.gpu.layers.linear_method import BatchInvariantError
    from vx.gpu.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel

    inner = model.model
    ok = type(inner) is LlamaModel and all(
        (type(layer), type(layer.self_attn), type(layer.mlp))
        == (LlamaDecoderLayer, LlamaAttention, LlamaMLP)
        and layer.self_attn.attn_fn is paged_attention
        for layer in inner.layers
    )
    if not ok:
        raise BatchInvariantError(
            f"--batch-invariant is implemented for the Llama decoder block (Llama, Mistral, "
            f"Qwen2); not for {type(model).__name__}"
        )
