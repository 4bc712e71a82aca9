"""The EngineCore's view of one request: its tokens, its progress and its lifecycle status.

Runs in: EngineCore (no torch, no I/O). Built by the Scheduler from an `AddRequest`; the
workers never see this object, only the `NewRequestData` / `CachedRequestData` diffs.
"""

from __future__ import annotations

import enum

from vx.messages import AddRequest, FinishReason
from vx.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    """A request's place in its lifecycle. The order matters: anything after PREEMPTED is
    finished (`RequestStatus.is_finished`), as in vLLM."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One request as the Scheduler tracks it.

    Token layout (positions): ``[prompt | known outputs | placeholders]``. `all_token_ids` holds
    the prompt and the known outputs (`num_tokens` of them); `num_output_placeholders` counts
    tokens an in-flight step will sample but whose ids are not known yet (async scheduling).

    Invariants:
    - ``num_computed_tokens <= num_tokens + num_output_placeholders``; the KV of the first
      `num_computed_tokens` positions is computed or scheduled in a step already sent.
    - ``len(block_hashes) == num_tokens // block_size`` whenever prefix caching is on (one hash
      per full block of *known* tokens; placeholders are never hashed).
    - ``num_tokens <= max_num_tokens``: the scheduler finishes the request with "length" when
      it reaches `max_num_tokens` = min(prompt + max_tokens, max_model_len), never later.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "cache_salt",
        "lora_id",
        "num_prompt_tokens",
        "all_token_ids",
        "num_tokens",
        "num_output_placeholders",
        "num_draft_slots",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "status",
        "stop_reason",
        "max_num_tokens",
        "min_tokens",
        "grammar_ends",
        "stop_token_set",
        "skip_reading_prefix_cache",
        "admitted_step_id",
        "spec_token_ids",
        "drafting",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        *,
        max_model_len: int,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        lora_id: int | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        num_prompt = len(prompt_token_ids)
        if num_prompt > max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {num_prompt} tokens exceeds "
                f"max_model_len {max_model_len}"
            )
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.num_prompt_tokens = num_prompt
        self.all_token_ids = list(prompt_token_ids)
        self.num_tokens = num_prompt
        self.num_output_placeholders = 0
        #: Draft slots of steps in flight (async scheduling), counted in `num_computed_tokens`
        #: until their output: a Worker's own computed count may be lower by up to this many
        #: (the rejected ones), so sliding windows free only by the count less them.
        self.num_draft_slots = 0
        self.num_computed_tokens = 0
        #: Prompt tokens served from the prefix cache at first admission (reported to the front).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        max_tokens = sampling_params.max_tokens
        limit = max_model_len if max_tokens is None else min(num_prompt + max_tokens, max_model_len)
        # A prompt of exactly max_model_len still samples one token (it needs no KV slot).
        self.max_num_tokens = max(limit, num_prompt + 1)
        self.min_tokens = sampling_params.min_tokens
        # EOS and the stop ids in one set: the hot path does a single membership test.
        stop_ids = set(sampling_params.stop_token_ids)
        #: A grammar's end ends the request: the Worker samples EOS only where the grammar
        #: allows it, and where the grammar is complete it gives EOS whatever min_tokens or
        #: ignore_eos say (`GrammarMatchers.end_where_stopped`), so that EOS stops it here.
        self.grammar_ends = sampling_params.structured_outputs is not None
        if eos_token_id is not None and (not sampling_params.ignore_eos or self.grammar_ends):
            stop_ids.add(eos_token_id)
        self.stop_token_set = frozenset(stop_ids)
        # Prompt logprobs need every prompt position computed, so no prefix-cache reads (vLLM).
        self.skip_reading_prefix_cache = sampling_params.prompt_logprobs is not None
        #: step_id of the schedule() that last admitted it; older steps' tokens are stale.
        self.admitted_step_id = -1
        #: Speculative decoding: drafts for its next step (rank 0's proposal), never known
        #: tokens: they are neither hashed nor counted in `num_tokens`.
        self.spec_token_ids: list[int] = []
        #: Speculative decoding with async scheduling: its latest output listed it among the
        #: drafting requests (drafts or not), so each of its steps gets draft slots until an
        #: output leaves it out; unlike `spec_token_ids` no step consumes it.
        self.drafting = False

    @classmethod
    def from_add_request(cls, msg: AddRequest, *, max_model_len: int) -> Request:
        return cls(
            msg.request_id,
            msg.prompt_token_ids,
            msg.sampling_params,
            msg.eos_token_id,
            max_model_len=max_model_len,
            arrival_time=msg.arrival_time,
            cache_salt=msg.cache_salt,
            lora_id=msg.lora_id,
        )

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the known output tokens (placeholders excluded)."""
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        """Append one sampled token (the scheduler's hot path inlines this)."""
        self.all_token_ids.append(token_id)
        self.num_tokens += 1

    def append_output_token_ids(self, token_ids: list[int]) -> tuple[int, str | None, int | None]:
        """Append tokens until one ends the request: (number appended, finish, stop reason)."""
        for k, token_id in enumerate(token_ids):
            self.append_output_token_id(token_id)
            finish_reason, stop_reason = self.check_stop(token_id)
            if finish_reason is not None:
                return k + 1, finish_reason, stop_reason
        return len(token_ids), None, None

    def check_stop(self, token_id: int) -> tuple[str | None, int | None]:
        """The stop rule, applied after `token_id` was appended: (finish_reason, stop_reason).

        A stop token (EOS unless ignore_eos, or one of stop_token_ids) ends the request once
        more than `min_tokens` outputs exist (a constrained request's EOS at once, whatever
        ignore_eos says: its grammar's end), i.e. no stop at output index < min_tokens (the
        sampler masks them there too); `stop_reason` is the token id for stop_token_ids and
        None for EOS, as in vLLM. Otherwise reaching `max_num_tokens` ends it with "length".
        The Scheduler's decode path inlines the cheap "neither can apply" test before this.
        """
        if token_id in self.stop_token_set and (
            self.num_tokens - self.num_prompt_tokens > self.min_tokens
            or (self.grammar_ends and token_id == self.eos_token_id)
        ):
            if token_id == self.eos_token_id and (
                not self.sampling_params.ignore_eos or self.grammar_ends
            ):
                return FinishReason.STOP, None
            return FinishReason.STOP, token_id
        if self.num_tokens >= self.max_num_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def __repr__(self) -> str:
        # Never the prompt: keep user text (and its token ids) out of logs.
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
