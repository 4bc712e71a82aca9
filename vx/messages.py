"""Every type that crosses a process boundary in vx, and nothing else.

Runs in: every process (imports no torch and no HF objects).

There are four rings, each with one writer:

1. ApiServer -> EngineCore (`EngineCoreInput`): `AddRequest`, `AbortRequests`, `UtilityRequest`,
   `Shutdown`.
2. EngineCore -> ApiServer (`EngineCoreEvent`): `EngineCoreOutputs` (one batch per engine step),
   `EngineReady`, `EngineDead`, `UtilityResult`.
3. EngineCore -> Workers, a broadcast (`WorkerInput`): `SchedulerOutput` (a diff against the
   workers' persistent batch), `Shutdown`.
4. Worker rank 0 -> EngineCore (`WorkerEvent`): `ModelRunnerOutput`, `WorkerReady`, `WorkerDead`.
   Other ranks send nothing: rank 0 reports ready once every rank has loaded.

All messages are frozen msgspec Structs tagged with their class name, encoded as msgpack by
`vx.ipc.codec`. Fields are primitives, lists, dicts and other Structs of this module: no tensors,
no pickle. All are `array_like` (positional msgpack arrays) to keep them small.
"""

from __future__ import annotations

import msgspec

from vx.sampling_params import SamplingParams

__all__ = [
    "AbortRequests",
    "AddRequest",
    "CachedRequestData",
    "EngineCoreEvent",
    "EngineCoreInput",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineDead",
    "EngineReady",
    "FinishReason",
    "Logprobs",
    "ModelRunnerOutput",
    "NewRequestData",
    "SAMPLE_FAILED",
    "SamplingParams",
    "SchedulerOutput",
    "SchedulerStats",
    "Shutdown",
    "UtilityRequest",
    "UtilityResult",
    "WorkerDead",
    "WorkerEvent",
    "WorkerInput",
    "WorkerReady",
]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Base: frozen, keyword-only, tagged by class name for union decoding.

    Every message is `array_like` (msgspec cannot mix the two forms in one union).
    """


class _StepMsg(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """Base for per-step messages: positional msgpack arrays, no GC tracking."""


# ─────────────────────────── 1. ApiServer -> EngineCore ───────────────────────────


class AddRequest(_Msg):
    """Sent by the ApiServer (or `vx.LLM`) when a request is admitted.

    The front has already tokenized, validated and fanned out `n > 1` into separate ids, so
    `sampling_params.n` is ignored here. `eos_token_id` is None for models without one.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    #: Extra keys for the prefix-cache block hash (isolates tenants sharing a prefix).
    cache_salt: str | None = None
    lora_id: int | None = None


class AbortRequests(_Msg):
    """Sent by the front when clients leave (or a stall/timeout fires).

    `cause` labels `vx:request_aborted_total{cause=...}`: "client_disconnect", "stall",
    "timeout", "shutdown" or "error"; "stop_string" ends a request whose text matched a stop
    string (the front counts that one as finished, not aborted).
    """

    request_ids: list[str]
    cause: str = "client_disconnect"


class UtilityRequest(_Msg):
    """A control call the EngineCore answers with `UtilityResult` of the same `call_id`.

    Methods: "reset_prefix_cache", "kv_self_check", "get_stats", and "kv_block_map" (args
    {"max_cells": int}; result {num_blocks, group_size, cells, cost_s}: the dashboard's map of
    the block pool, polled only while someone watches).
    """

    call_id: int
    method: str
    args: dict[str, object] = {}


class Shutdown(_Msg):
    """Sent down every ring to ask the reader to exit cleanly after draining."""

    reason: str = ""


EngineCoreInput = AddRequest | AbortRequests | UtilityRequest | Shutdown


# ─────────────────────────── 2. EngineCore -> ApiServer ───────────────────────────


class FinishReason:
    """The string values of `EngineCoreOutput.finish_reason` (OpenAI's names plus vLLM's)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Logprobs(_StepMsg, frozen=True):
    """Logprobs for consecutive positions of one request.

    Row i is one position: `token_ids[i][0]` / `logprobs[i][0]` is the sampled (or prompt)
    token, followed by the top-k alternatives in descending order; `ranks[i]` is the sampled
    token's 1-based rank in the full distribution. For `prompt_logprobs`, row i is prompt
    position i + 1 (the first prompt token has no logprob), so there are P - 1 rows.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(_StepMsg, frozen=True):
    """What one request gained in one step. `finish_reason` is set on its last output."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    #: The stop token id that ended the request, when one did.
    stop_reason: int | None = None
    new_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    #: A human-readable reason when finish_reason is "error".
    error: str | None = None
    #: On a request's first output after it was scheduled (first, or again after a
    #: preemption): when the EngineCore scheduled it (epoch seconds), for the trace's
    #: "scheduled" event and its queue time.
    scheduled_time: float | None = None


class SchedulerStats(_StepMsg, frozen=True):
    """A snapshot of the EngineCore after a step, for /metrics and the dashboard."""

    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    prefix_queries_total: int
    prefix_hits_total: int
    step_num_prefill_tokens: int = 0
    step_num_decode_tokens: int = 0
    step_token_budget: int = 0
    step_time_s: float = 0.0
    #: Host-side time of this step split by phase (schedule, ipc wait, update), seconds.
    schedule_time_s: float = 0.0
    update_time_s: float = 0.0
    #: Speculative decoding: drafts scored and accepted so far, and accepted by draft position.
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_num_accepted_by_position: list[int] = []
    #: Unfinished requests whose output follows a grammar (structured outputs, tool calls).
    num_constrained: int = 0


class EngineCoreOutputs(_StepMsg, frozen=True):
    """Everything one engine step produced, sent once per step (batched, never per token)."""

    engine_index: int
    outputs: list[EngineCoreOutput]
    timestamp: float
    scheduler_stats: SchedulerStats | None = None


class EngineReady(_Msg):
    """Sent once, after every worker reported ready and the KV pool is sized.

    `worker_pids` lists every Worker process of this EngineCore, one per TP rank, in rank order.
    """

    engine_index: int
    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_cache_bytes: int
    engine_pid: int
    worker_pids: list[int]
    async_scheduling: bool
    #: `--batch-invariant` is on (the Workers loaded the invariant paths).
    batch_invariant: bool = False


class EngineDead(_Msg):
    """Sent (best effort) when the EngineCore is about to die; the front also watches pids.

    `exit_code`: the `vx.exit_code.ExitCode` the failure calls for (0: the front decides, by
    whether the engine was ready), e.g. KV_CACHE_TOO_SMALL from a Worker's start-up.
    """

    engine_index: int
    reason: str
    exit_code: int = 0


class UtilityResult(_Msg):
    """The answer to a `UtilityRequest`; `error` is set when the call failed."""

    call_id: int
    result: dict[str, object] = {}
    error: str | None = None


EngineCoreEvent = EngineCoreOutputs | EngineReady | EngineDead | UtilityResult


# ─────────────────────────── 3. EngineCore -> Workers ───────────────────────────


class NewRequestData(_StepMsg, frozen=True):
    """A request the workers have not seen (or are seeing again after preemption).

    `output_token_ids` is non-empty only for a request resumed after preemption: its KV is
    recomputed from `prompt_token_ids + output_token_ids`, and the sampler's penalty and seed
    state need to know which tokens were outputs. With G KV-cache groups (`WorkerReady.
    kv_group_windows`), `block_ids` (and each of `CachedRequestData.new_block_ids`) is every
    group's ids in turn, as many each; -1 is a block freed out of a window (never read).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []
    eos_token_id: int | None = None


class CachedRequestData(_StepMsg, frozen=True):
    """Requests already in the workers' persistent batch, column-wise.

    Only the new block ids and the computed count travel; the workers know the tokens, because
    rank 0 sampled them (this is what lets async scheduling run ahead of the outputs).
    With pipeline parallel only the last stage samples: `new_token_ids[i]` then holds request
    i's known tokens from max(num_computed_tokens, its prompt length) to the end of this
    step's tokens, for the earlier stages to append what they lack (empty without PP).
    """

    req_ids: list[str]
    new_block_ids: list[list[int]]
    num_computed_tokens: list[int]
    new_token_ids: list[list[int]] = []


class SchedulerOutput(_StepMsg, frozen=True):
    """The diff for one step, broadcast to every worker.

    Invariants: every id in `num_scheduled_tokens` is in exactly one of `scheduled_new_reqs` or
    `scheduled_cached_reqs`; `total_num_scheduled_tokens == sum(num_scheduled_tokens.values())`;
    `finished_req_ids` and `preempted_req_ids` name requests the workers must drop before this
    step runs.
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    preempted_req_ids: list[str] = []
    #: Speculative decoding: each drafting request's draft tokens, scored this step after its
    #: last known token (its `num_scheduled_tokens` is 1 + len(drafts)). With async
    #: scheduling they are slots (-1): the Workers fill them with the drafts they proposed
    #: after the step before, and score fewer where they have fewer.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    #: `--profile-steps`: when the EngineCore sent it (epoch s; 0 otherwise), so that a Worker
    #: can time its delivery.
    sent_at: float = 0.0


WorkerInput = SchedulerOutput | Shutdown


# ─────────────────────────── 4. Worker -> EngineCore ───────────────────────────


#: The token a request reports in `ModelRunnerOutput.sampled_token_ids` when its sampling
#: raised in the Worker; the EngineCore finishes it alone, with finish_reason "error".
SAMPLE_FAILED = -1


class ModelRunnerOutput(_StepMsg, frozen=True):
    """Rank 0's result for one step.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; it is empty for a prefill chunk that did
    not reach the end of the known tokens (nothing is sampled there). A drafting request's
    holds its accepted drafts, then its own token (1 to 1 + len(drafts) tokens).
    """

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Logprobs | None] | None = None
    prompt_logprobs: dict[str, Logprobs] | None = None
    #: Worker-side time of the step (prepare + forward + sample), seconds.
    execute_time_s: float = 0.0
    #: Speculative decoding: the drafts rank 0 proposes for each request's next step.
    spec_token_ids: dict[str, list[int]] | None = None
    #: `--profile-steps`: when the driver sent it (epoch s; 0 otherwise), so that the
    #: EngineCore can time its delivery.
    sent_at: float = 0.0
    #: Async scheduling with drafts: how many of each drafting request's draft slots the
    #: Worker filled with drafts of its own and scored (None: every slot held a draft).
    spec_num_scored: dict[str, int] | None = None


class WorkerReady(_Msg):
    """Sent once by each worker after loading the model and sizing its KV pool."""

    rank: int
    pid: int
    num_blocks: int
    kv_cache_bytes: int
    device: str
    #: The window (keys) every layer of the model attends within, the widest where they differ,
    #: or None when some layer is global: the KV manager frees the blocks that slide out of it.
    sliding_window: int | None = None
    #: The KV-cache groups' windows (keys; 0: global), global groups first, when the layers
    #: attend in different ways (`vx.gpu.kv_cache.kv_cache_groups`); empty: one group. Block
    #: ids then travel group by group (`NewRequestData.block_ids`).
    kv_group_windows: list[int] = []


class WorkerDead(_Msg):
    """Sent (best effort) by a worker that hit a fatal error; `exit_code` as in EngineDead."""

    rank: int
    reason: str
    exit_code: int = 0


WorkerEvent = ModelRunnerOutput | WorkerReady | WorkerDead
