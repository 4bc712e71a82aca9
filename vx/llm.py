"""`vx.LLM`: the offline class, through the same EngineCore, Workers and rings as the server.

Runs in: the user's process, which plays the front's part: it tokenizes, fans out `n > 1`,
sends `AddRequest`s, reads the engine's per-step outputs, applies stop strings and detokenizes.
As in vLLM, its default token budget is twice the server's.

Invariant: `generate()` returns one `RequestOutput` per prompt, in prompt order, and leaves no
request behind in the engine (stop strings abort the engine request the moment they match).
"""

from __future__ import annotations

import itertools
import json
import logging
import operator
import os
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from vx import messages
from vx.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_speculative_config,
)
from vx.engine_procs import EngineProcesses, resolve_engine_config
from vx.errors import EngineDeadError, EngineStartupError
from vx.ipc import codec
from vx.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0

#: One prompt of `LLM.generate`: text, token ids, or vLLM's `TextPrompt` / `TokensPrompt` dict.
Prompt = str | list[int] | dict[str, Any]


def _model_vocab(path: str) -> int:
    """The vocabulary size in the model directory's config.json (a text config's where the
    model nests one), or 0."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return int(cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or 0)


def _is_token_id(x: object) -> bool:
    """An int-like token id (numpy's too), not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class _Pending:
    """One engine request (one of a prompt's n samples) while it runs."""

    output: CompletionOutput
    params: SamplingParams
    engine_index: int


class LLM:
    """Offline batch generation: `LLM(model).generate(prompts, sampling_params)`."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        dtype: str = "auto",
        quantization: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        kv_cache_memory: int | None = None,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = True,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        num_threads: int | None = None,
        seed: int = 0,
        device: str = "cpu",
        enforce_eager: bool = False,
        gpu_memory_utilization: float = 0.92,
        batch_invariant: bool = False,
        speculative_config: dict | str | None = None,
    ) -> None:
        from vx.models_hub.device import resolve_scheduler_defaults  # no torch import

        max_num_seqs, budget = resolve_scheduler_defaults(
            device,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            offline=True,
        )
        speculative = parse_speculative_config(speculative_config)
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                quantization=quantization,
            ),
            cache=CacheConfig(
                kv_cache_memory_bytes=kv_cache_memory,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                num_blocks_override=num_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                async_scheduling=async_scheduling,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                data_parallel_size=data_parallel_size,
            ),
            device=device,
            num_threads=num_threads,
            enforce_eager=enforce_eager,
            batch_invariant=batch_invariant,
            speculative=speculative,
        )
        self.config = resolve_engine_config(config)
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.config.model.path)
        #: Token ids a prompt may hold: below the model's embedding rows, which may outnumber
        #: the tokenizer's tokens (a padded vocabulary), or the tokenizer's, the larger
        self._vocab_size = max(len(self.tokenizer), _model_vocab(self.config.model.path))
        self._in_codec = codec.engine_input_codec()
        self._out_codec = codec.engine_event_codec()
        self._ids = itertools.count()
        self._procs = EngineProcesses(self.config)
        self._procs.start()
        try:
            self.ready = [self._wait_ready(i) for i in range(len(self._procs.ranks))]
        except BaseException:
            self._procs.close()
            raise
        self._load = [0] * len(self.ready)
        #: Grammars compiled here before admission (`_check_grammar`), built on first use.
        self._grammars: Any = None

    # ── lifecycle ──────────────────────────────────────────────────────────────
    def _wait_ready(self, index: int) -> messages.EngineReady:
        rank = self._procs.ranks[index]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                event = self._out_codec.decode(rank.from_engine.recv(timeout=1.0))
            except TimeoutError:
                dead = [p.name for p in rank.processes if p.exitcode is not None]
                if dead:
                    raise EngineStartupError(f"{', '.join(dead)} exited during start-up") from None
                if time.monotonic() > deadline:
                    raise EngineStartupError("the engine did not become ready in time") from None
                continue
            if isinstance(event, messages.EngineReady):
                return event
            if isinstance(event, messages.EngineDead):
                raise EngineStartupError(f"engine {index} failed to start: {event.reason}")

    def close(self) -> None:
        self._procs.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        procs = getattr(self, "_procs", None)
        if procs is not None:
            procs.close()

    # ── public API ─────────────────────────────────────────────────────────────
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order. A prompt is text, a
        list of token ids, or vLLM's prompt dicts (`{"prompt": text}`, `{"prompt_token_ids":
        ids}`). Raises ValueError, before any request is sent, for a prompt of another shape or
        a token id outside the vocabulary (the model's or the tokenizer's, the larger)."""
        if isinstance(prompts, (str, dict)) or (prompts and _is_token_id(prompts[0])):
            prompts = [prompts]  # type: ignore[list-item]
        items = [self._prompt_item(p, i) for i, p in enumerate(prompts)]  # type: ignore[union-attr]
        return self._run(items, sampling_params, use_tqdm=use_tqdm)

    def _prompt_item(self, prompt: Prompt, index: int) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt of `generate`'s."""
        p: Any = prompt
        if isinstance(p, dict):
            keys = {"prompt", "prompt_token_ids"} & p.keys()
            if len(keys) != 1:
                raise ValueError(
                    f"prompt {index}: a dict prompt needs 'prompt' or 'prompt_token_ids' (one)"
                )
            p = p[keys.pop()]
        if isinstance(p, str):
            return p, self.tokenizer.encode(p)
        if isinstance(p, (list, tuple)) and all(_is_token_id(t) for t in p):
            ids = [operator.index(t) for t in p]
            vocab = self._vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(
                    f"prompt {index}: token id {bad} is out of vocabulary (size {vocab})"
                )
            return None, ids
        raise ValueError(
            f"prompt {index}: expected text, a list of token ids or a prompt dict, "
            f"got {type(p).__name__}"
        )

    def chat(
        self,
        conversations: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        items: list[tuple[str | None, list[int]]] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=True
            )
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm=use_tqdm)

    def call_utility(self, method: str, engine: int = 0, **args: object) -> dict[str, object]:
        """Run a control call (`kv_self_check`, `reset_prefix_cache`, `get_stats`) and wait."""
        call_id = next(self._ids)
        self._send(engine, messages.UtilityRequest(call_id=call_id, method=method, args=args))
        rank = self._procs.ranks[engine]
        while True:
            event = self._out_codec.decode(rank.from_engine.recv(timeout=30.0))
            if isinstance(event, messages.UtilityResult) and event.call_id == call_id:
                if event.error:
                    raise RuntimeError(event.error)
                return event.result
            if isinstance(event, messages.EngineDead):
                raise EngineDeadError(event.reason)

    # ── the loop ───────────────────────────────────────────────────────────────
    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        *,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        )
        if len(params_list) != len(items):
            raise ValueError("sampling_params must be one value or one per prompt")
        max_len = self.config.model.max_model_len or 0
        eos = self.tokenizer.eos_token_id
        results: list[RequestOutput] = []
        pending: dict[str, _Pending] = {}
        for params in params_list:
            params.validate()
            self._check_grammar(params)
        for (text, ids), params in zip(items, params_list, strict=True):
            if not ids:
                raise ValueError("a prompt must have at least one token")
            if len(ids) + (params.max_tokens or 1) > max_len:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) plus max_tokens exceeds max_model_len {max_len}"
                )
            result = RequestOutput(
                request_id=str(next(self._ids)), prompt=text, prompt_token_ids=ids
            )
            results.append(result)
            for i in range(params.n):
                out = CompletionOutput(index=i, text="", token_ids=[], finish_reason=None)
                result.outputs.append(out)
                request_id = f"{result.request_id}-{i}"
                engine = min(range(len(self._load)), key=self._load.__getitem__)
                self._load[engine] += 1
                choice = params.for_choice(i)  # seed + i, as over HTTP
                pending[request_id] = _Pending(out, choice, engine)
                self._send(
                    engine,
                    messages.AddRequest(
                        request_id=request_id,
                        prompt_token_ids=ids,
                        sampling_params=choice,
                        eos_token_id=eos,
                        arrival_time=time.time(),
                    ),
                )
        total = len(pending)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="Processed prompts", unit="req")
        try:
            while pending:
                for engine in range(len(self._procs.ranks)):
                    if self._load[engine]:
                        self._poll(engine, pending, bar)
        finally:
            if bar is not None:
                bar.close()
            if pending:  # interrupted: leave nothing running in the engine
                for engine in range(len(self._procs.ranks)):
                    ids_ = [rid for rid, p in pending.items() if p.engine_index == engine]
                    if ids_:
                        self._send(engine, messages.AbortRequests(request_ids=ids_, cause="error"))
        for result, params in zip(results, params_list, strict=True):
            for out in result.outputs:
                if not isinstance(out.stop_reason, str):  # a stop string already cut the text
                    out.text = self.tokenizer.decode(
                        out.token_ids, skip_special_tokens=params.skip_special_tokens
                    )
        return results

    def _check_grammar(self, params: SamplingParams) -> None:
        """Compile the output constraint once (cached), so that a bad one raises a ValueError
        (`vx.grammar.GrammarError`) here instead of failing in the Worker."""
        if params.structured_outputs is None:
            return
        from vx.grammar import GrammarCache, fingerprint_of, grammar_of, load_ll_tokenizer

        if self._grammars is None:
            text = self.tokenizer.backend_tokenizer.to_str()
            eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
            tok = load_ll_tokenizer(text, vocab_size=None, eos_token_ids=eos)
            self._grammars = GrammarCache(tok, fingerprint_of(text, None, eos))
        self._grammars.matcher(grammar_of(params.structured_outputs))

    def _send(self, engine: int, msg: messages.EngineCoreInput) -> None:
        self._procs.ranks[engine].to_engine.send(self._in_codec.encode(msg))

    def _poll(self, engine: int, pending: dict[str, _Pending], bar: Any) -> None:
        rank = self._procs.ranks[engine]
        try:
            data = rank.from_engine.recv(timeout=1.0)
        except TimeoutError:
            dead = [p.name for p in rank.processes if p.exitcode is not None]
            if dead:
                raise EngineDeadError(f"{', '.join(dead)} died") from None
            return
        except (anyio.BrokenResourceError, anyio.EndOfStream):
            raise EngineDeadError(f"engine {engine} died") from None
        event = self._out_codec.decode(data)
        if isinstance(event, messages.EngineDead):
            raise EngineDeadError(f"engine {engine} died: {event.reason}")
        if not isinstance(event, messages.EngineCoreOutputs):
            return
        for o in event.outputs:
            p = pending.get(o.request_id)
            if p is None:
                continue
            out = p.output
            out.token_ids.extend(o.new_token_ids)
            if o.new_logprobs is not None:
                if out.logprobs is None:
                    out.logprobs = []
                for ids, lps in zip(o.new_logprobs.token_ids, o.new_logprobs.logprobs, strict=True):
                    out.logprobs.append(dict(zip(ids, lps, strict=True)))
            if o.finish_reason is None and p.params.stop:
                self._check_stop_strings(o.request_id, p, engine)
            elif o.finish_reason is not None:
                out.finish_reason = o.finish_reason
                out.stop_reason = o.stop_reason
                if p.params.stop:
                    self._check_stop_strings(o.request_id, p, engine, finished=True)
            if out.finish_reason is not None:
                del pending[o.request_id]
                self._load[engine] -= 1
                if bar is not None:
                    bar.update(1)

    def _check_stop_strings(
        self, request_id: str, p: _Pending, engine: int, *, finished: bool = False
    ) -> None:
        """Truncate at the first stop string; abort the engine request when one matches."""
        out = p.output
        text = self.tokenizer.decode(
            out.token_ids, skip_special_tokens=p.params.skip_special_tokens
        )
        hits = [(text.find(s), s) for s in p.params.stop if s in text]
        if not hits:
            return
        pos, stop = min(hits)
        out.text = text[: pos + len(stop)] if p.params.include_stop_str_in_output else text[:pos]
        out.finish_reason = messages.FinishReason.STOP
        out.stop_reason = stop
        if not finished:
            self._send(
                engine, messages.AbortRequests(request_ids=[request_id], cause="stop_string")
            )
