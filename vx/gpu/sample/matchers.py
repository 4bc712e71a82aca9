"""GrammarMatchers: the parse state of every constrained request in a Worker's batch, and the
allowed-token mask each one puts on its row's logits before sampling.

Runs in: each Worker process (vx/gpu). The model runner calls `apply` with each step's diff,
`mask_logits` on the logits of the rows that sample, and `accept` with the tokens sampled.
In a greedy step whose tokens come from the LM head's argmax (the fused C step), only the
constrained rows' logits are formed and masked, and their tokens re-taken from them, so the
unconstrained rows beside them keep that path.

Why here and not in the EngineCore (where vLLM keeps its StructuredOutputManager): with async
scheduling the EngineCore schedules step n+1 before it knows step n's token, so it cannot fill
step n+1's mask without waiting for step n (vLLM defers those rows). The Worker knows each
token the moment it samples it, so the mask for the next step is always current, the
EngineCore keeps its two steps in flight, and no bitmask crosses a ring.

The masks are filled on the Worker's own thread, one row after another, between the forward
and the sampler: llguidance's parallel fill would start threads that fight the OpenMP compute
threads for the cores (vLLM #49013), and one row's fill is small beside a step
(docs/performance.md, "Structured outputs").

Invariants:
- a request has a matcher iff its `SamplingParams.structured_outputs` is set and it is in the
  batch; the matcher has consumed exactly the request's output tokens so far (a request resumed
  after preemption replays its `output_token_ids` into a fresh matcher);
- an unconstrained step does nothing here: `num_active == 0` short-circuits every call;
- a new grammar compiles on one background thread from the moment its request joins the batch
  and is waited for only when the request first samples: its compile overlaps the forward
  (and any later prefill chunks); a cached one is a copy made at once;
- a matcher in an error state (a grammar the Worker could not compile, which the front
  refuses first) allows only the request's EOS, so the request ends instead of running free.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import pathlib
import threading
import time
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
import torch

from vx.grammar import GrammarCache, GrammarError, fingerprint_of, grammar_of, load_ll_tokenizer
from vx.messages import NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

__all__ = ["GrammarMatchers"]


def _model_eos_token_id(model_path: pathlib.Path, tokenizer_json: str) -> int | None:
    """The EOS the ApiServer will send with each request (`Tokenizer.eos_token_id`: the
    tokenizer's own EOS, else generation_config.json's first), or None where unknown."""
    from tokenizers import Tokenizer

    try:
        cfg = json.loads((model_path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    eos = cfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str):
        token_id = Tokenizer.from_str(tokenizer_json).token_to_id(eos)
        if token_id is not None:
            return token_id
    try:
        gen = json.loads((model_path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return None
    return gen[0] if isinstance(gen, list) and gen else gen if isinstance(gen, int) else None


#: A row whose mask allows tokens in at most this many 32-token words is masked by saving
#: the allowed logits, filling the row with -inf and putting them back (a JSON key or
#: punctuation allows a few dozen tokens); a denser one by a masked write over the row.
SPARSE_WORDS = 64
_BIT_INDEX = np.arange(32, dtype=np.int32)
#: A constrained row whose grammar allows at most this many tokens has only their logits
#: formed (`GrammarMatchers.masked_logits`).
SPARSE_TOKENS = 2048


def _forbidden(bitmask: np.ndarray, width: int) -> np.ndarray:
    """[rows, width] bools, True where the bitmask forbids the token. Bit j of word w allows
    token 32 w + j (little-endian bits): the inverted words' bits, unpacked, are 0/1 bytes
    already, viewed as bools with no comparison pass (one cost more than the fill itself)."""
    inverted = np.invert(bitmask).view(np.uint8)
    return np.unpackbits(inverted, axis=-1, bitorder="little")[..., :width].view(np.bool_)


def _mask_row(row: np.ndarray, words: np.ndarray) -> None:
    """Set `row`'s forbidden logits (per the bitmask `words`) to -inf, in place."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) <= SPARSE_WORDS:
        bits = ((words[nonzero][:, None] >> _BIT_INDEX) & 1).astype(np.bool_)
        allowed = (nonzero[:, None] * 32 + _BIT_INDEX)[bits]
        allowed = allowed[allowed < row.shape[0]]
        kept = row[allowed]
        row.fill(-np.inf)
        row[allowed] = kept
        return
    row[_forbidden(words, row.shape[0])] = -np.inf  # measured ahead of putmask and copyto


class _Row:
    """One constrained request: its matcher (or the compile that will give it, with the
    output tokens to replay into it) and the EOS that ends it."""

    __slots__ = ("eos_token_id", "failed", "matcher", "pending", "replay")

    def __init__(self, eos_token_id: int | None) -> None:
        self.matcher: llguidance.LLMatcher | None = None
        self.pending: concurrent.futures.Future | None = None
        self.replay: list[int] = []
        self.eos_token_id = eos_token_id
        self.failed = False

    def set_matcher(self, matcher: llguidance.LLMatcher | None, req_id: str) -> None:
        self.matcher, self.failed = matcher, matcher is None
        if matcher is not None and self.replay:  # resumed after preemption
            if not matcher.consume_tokens(self.replay):
                logger.warning("request %s: its output no longer parses on resume", req_id)
                self.failed = True
        self.replay = []

    def resolve(self, req_id: str) -> None:
        """Wait for a compile still running (it ran beside the forward)."""
        future, self.pending = self.pending, None
        assert future is not None
        try:
            self.set_matcher(future.result(), req_id)
        except GrammarError as e:
            logger.warning("request %s: grammar failed in the worker: %s", req_id, e)
            self.set_matcher(None, req_id)


class GrammarMatchers:
    """See the module docstring. `model_path` holds the `tokenizer.json` the grammars are
    compiled against; `vocab_size` is the logits' width."""

    def __init__(self, model_path: str, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._model_path = pathlib.Path(model_path)
        self._rows: dict[str, _Row] = {}
        # One cache per EOS id (the grammar's end allows the request's EOS).
        self._caches: dict[int | None, GrammarCache] = {}
        self._tokenizer_json: str | None = None
        self._bitmask = np.empty((0, 0), dtype=np.int32)
        self._ended: list[int] = []
        self._ended_rows: list[int] = []
        #: Totals for the step profile: rows masked and seconds spent filling masks.
        self.num_rows_masked = 0
        self.mask_time_s = 0.0
        self._lock = threading.Lock()
        #: New grammars compile here, one at a time, beside the step's forward.
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # Reading the tokenizer and building llguidance's view of it for the model's EOS
        # (about 0.2 s) start now, off the step loop: the first constrained request finds
        # them ready.
        self._loader = threading.Thread(target=self._prepare, daemon=True)
        self._loader.start()

    @property
    def num_active(self) -> int:
        return len(self._rows)

    def is_constrained(self, req_id: str) -> bool:
        return req_id in self._rows

    def allows(self, req_id: str, token_id: int) -> bool:
        """Whether constrained request `req_id`'s grammar allows `token_id` next. Why: a
        greedy row whose unmasked argmax is allowed has it as its masked argmax too, and needs
        no logits and no mask at all. One token's check walks the grammar for that token
        only; a mask walks it for the whole vocabulary (hundreds of µs for a free regex)."""
        row = self._resolve(req_id, self._rows[req_id])
        m = row.matcher
        if row.failed or m is None or m.is_error():
            return token_id == row.eos_token_id
        if token_id == row.eos_token_id:  # the mask allows EOS where the grammar may end
            return m.is_accepting()
        return m.validate_tokens([token_id]) == 1

    def _prepare(self) -> None:
        path = self._model_path / "tokenizer.json"
        try:
            self._tokenizer_json = path.read_text()
        except OSError as e:
            logger.warning("structured outputs unavailable: cannot read %s (%s)", path, e)
            return
        eos = _model_eos_token_id(self._model_path, self._tokenizer_json)
        try:
            self._build_cache(eos)
        except Exception:  # the first constrained request retries, and reports it
            logger.exception("building the grammar tokenizer failed")

    def _cache(self, eos_token_id: int | None) -> GrammarCache:
        cache = self._caches.get(eos_token_id)
        if cache is None:
            self._loader.join()
            if self._tokenizer_json is None:
                raise GrammarError("the model has no tokenizer.json to compile grammars with")
            cache = self._build_cache(eos_token_id)
        return cache

    def _build_cache(self, eos_token_id: int | None) -> GrammarCache:
        with self._lock:
            cache = self._caches.get(eos_token_id)
            if cache is not None:
                return cache
            assert self._tokenizer_json is not None
            eos = [eos_token_id] if eos_token_id is not None else []
            t0 = time.perf_counter()
            tok = load_ll_tokenizer(self._tokenizer_json, vocab_size=self.vocab_size,
                                    eos_token_ids=eos)  # fmt: skip
            logger.info("grammar tokenizer built in %.3f s", time.perf_counter() - t0)
            fp = fingerprint_of(self._tokenizer_json, self.vocab_size, eos)
            cache = self._caches[eos_token_id] = GrammarCache(tok, fp)
            return cache

    # ─────────────────────────── the batch's diff ───────────────────────────

    def apply(self, so: SchedulerOutput) -> None:
        """Drop finished and preempted requests; add the new (or resumed) constrained ones."""
        if self._rows:
            for req_id in so.finished_req_ids:
                self._rows.pop(req_id, None)
            for req_id in so.preempted_req_ids:
                self._rows.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.sampling_params.structured_outputs is not None:
                self._add(new)

    def _add(self, new: NewRequestData) -> None:
        """A cached grammar's matcher is a copy, made now; a new grammar compiles on the
        compile thread, beside this step's forward (and any further prefill chunks), and
        the row waits for it only when it first samples (`_resolve`)."""
        spec = new.sampling_params.structured_outputs
        assert spec is not None
        row = self._rows[new.req_id] = _Row(new.eos_token_id)
        row.replay = list(new.output_token_ids)
        try:
            cache = self._cache(new.eos_token_id)
            text = grammar_of(spec)
        except GrammarError as e:
            logger.warning("request %s: grammar failed in the worker: %s", new.req_id, e)
            row.set_matcher(None, new.req_id)
            return
        if cache.contains(text):
            try:
                row.set_matcher(cache.matcher(text), new.req_id)
            except GrammarError as e:
                logger.warning("request %s: grammar failed in the worker: %s", new.req_id, e)
                row.set_matcher(None, new.req_id)
            return
        row.pending = self._compiler.submit(cache.matcher, text)

    def _resolve(self, req_id: str, row: _Row) -> _Row:
        if row.pending is not None:
            row.resolve(req_id)
        return row

    # ─────────────────────────── per step ───────────────────────────

    def mask_logits(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        drafts: dict[str, list[int]] | None = None,
    ) -> None:
        """Set to -inf every token the grammar forbids, in the rows of constrained requests.

        `logits[i]` is the row of `req_ids[i]`; other rows are left as they are. A request
        with drafts (speculative decoding, `drafts[req_id]`) has 1 + k consecutive rows, and
        row j is masked by the state its grammar reaches after drafts[:j]: the matcher walks
        the drafts it allows and rolls back at once (`_fill_drafts`). Rows past a draft the
        grammar forbids keep that draft's mask (that draft is rejected: they are never used).
        """
        rows = [(i, r, self._resolve(r, self._rows[r])) for i, r in enumerate(req_ids)
                if r in self._rows]  # fmt: skip
        self._ended_rows = []
        if not rows:
            return
        t0 = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = np.empty((max(len(rows), 8), words), dtype=np.int32)
        bitmask = self._bitmask
        self._ended = []
        k = 0
        while k < len(rows):
            req_id, row = rows[k][1], rows[k][2]
            d = drafts.get(req_id) if drafts else None
            if d:
                self._fill_drafts(row, d, bitmask, k)
                k += len(d) + 1
            else:
                self._fill(row, bitmask, k)
                k += 1
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and (
            logits.is_contiguous()
        ):
            view = logits.numpy()  # the same memory: rows are masked in place
            for k, (i, _, _) in enumerate(rows):
                _mask_row(view[i], bitmask[k])
        else:
            forbid = torch.from_numpy(_forbidden(bitmask[: len(rows)], logits.shape[1]))
            forbid = forbid.to(logits.device)
            for k, (i, _, _) in enumerate(rows):
                logits[i].masked_fill_(forbid[k], float("-inf"))
        #: the logits rows whose mask allowed EOS alone (`end_masked_rows`)
        self._ended_rows = [rows[k][0] for k in self._ended]
        self.num_rows_masked += len(rows)
        self.mask_time_s += time.perf_counter() - t0

    def masked_logits(self, model: Any, hidden: torch.Tensor, req_ids: list[str]) -> torch.Tensor:
        """[len(req_ids), vocab] float32: the logits of the constrained requests' rows
        `hidden` (row i is `req_ids[i]`'s), each token its grammar forbids at -inf.

        Where every row's grammar allows at most SPARSE_TOKENS tokens (a JSON answer's first
        token, a key, punctuation), only those tokens' logits are formed
        (`model.compute_logits_of`), instead of a second pass over the whole LM head."""
        t0 = time.perf_counter()
        allowed = [self._allowed_ids(r) for r in req_ids]
        self.mask_time_s += time.perf_counter() - t0
        if all(a is not None for a in allowed):
            ids = np.unique(np.concatenate(allowed))  # type: ignore[arg-type]
            part = model.compute_logits_of(hidden, torch.from_numpy(ids))
            if part is not None:
                logits = torch.full((len(req_ids), self.vocab_size), float("-inf"))
                for i, a in enumerate(allowed):
                    a_t = torch.from_numpy(a)  # type: ignore[arg-type]
                    logits[i, a_t] = part[i, torch.from_numpy(np.searchsorted(ids, a))]
                self.num_rows_masked += len(req_ids)
                return logits
        logits = model.compute_logits(hidden)
        self.mask_logits(logits, req_ids)
        return logits

    def _allowed_ids(self, req_id: str) -> np.ndarray | None:
        """The token ids `req_id`'s grammar allows next, ascending, where at most
        SPARSE_TOKENS; else None."""
        row = self._resolve(req_id, self._rows[req_id])
        m = row.matcher
        if row.failed or m is None or m.is_error():
            eos = row.eos_token_id
            return None if eos is None else np.array([eos], dtype=np.int64)
        words = (self.vocab_size + 31) // 32
        if self._bitmask.shape[1] != words:
            self._bitmask = np.empty((8, words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(m, self._bitmask, 0)
        bits = self._bitmask[0]
        nonzero = np.flatnonzero(bits)
        if len(nonzero) > SPARSE_TOKENS:
            return None
        set_bits = ((bits[nonzero][:, None] >> _BIT_INDEX) & 1).astype(np.bool_)
        ids = (nonzero[:, None] * 32 + _BIT_INDEX)[set_bits]
        ids = ids[ids < self.vocab_size].astype(np.int64)
        return ids if len(ids) <= SPARSE_TOKENS else None

    def end_where_stopped(self, req_ids: list[str], token_ids: np.ndarray) -> np.ndarray:
        """`token_ids` (row i is `req_ids[i]`'s), with EOS for each constrained request whose
        grammar is complete or failed (it allows nothing but EOS). Why: min_tokens keeps EOS
        from the sampler, which then has no token left to pick (ignore_eos, for its part,
        would emit EOS until max_tokens); the grammar's end ends the request instead, and the
        EngineCore stops a constrained request at its EOS (`Request.grammar_ends`)."""
        out = token_ids
        for k, req_id in enumerate(req_ids):
            row = self._rows.get(req_id)
            token = int(token_ids[k])
            if row is None or row.eos_token_id is None or token in (row.eos_token_id, -1):
                continue
            if row.pending is not None:
                row.resolve(req_id)
            if row.failed or row.matcher is None or row.matcher.is_stopped():
                if out is token_ids:
                    out = np.array(token_ids, dtype=np.int64, copy=True)
                out[k] = row.eos_token_id
        return out

    def _fill(self, row: _Row, bitmask: np.ndarray, k: int) -> None:
        """Bitmask row `k`: what `row`'s grammar allows next (its EOS alone where it failed).
        Where that is EOS alone (complete or failed), `k` joins `_ended` (`end_masked_rows`)."""
        m = row.matcher
        if row.failed or m is None or m.is_error():
            bitmask[k] = 0
            if row.eos_token_id is not None:
                bitmask[k, row.eos_token_id >> 5] = np.int32(
                    np.uint32(1 << (row.eos_token_id & 31)).view(np.int32)
                )
                self._ended.append(k)
            return
        llguidance.numpy.fill_next_token_bitmask(m, bitmask, k)
        if row.eos_token_id is not None and m.is_stopped():
            self._ended.append(k)

    def end_masked_rows(self, req_ids: list[str], token_ids: np.ndarray) -> np.ndarray:
        """After `mask_logits(logits, req_ids, drafts)` and sampling: `token_ids` (row i is
        logits row i), with EOS in each row whose mask allowed EOS alone, as
        `end_where_stopped` does for a step without drafts; a draft row's state is the one
        after the drafts before it. A failed sample (-1) stays."""
        out = token_ids
        for i in self._ended_rows:
            eos = self._rows[req_ids[i]].eos_token_id
            if int(token_ids[i]) not in (-1, eos):
                if out is token_ids:
                    out = np.array(token_ids, dtype=np.int64, copy=True)
                out[i] = eos
        return out

    def _fill_drafts(self, row: _Row, drafts: list[int], bitmask: np.ndarray, k: int) -> None:
        """Bitmask rows k .. k + len(drafts): row k + j after drafts[:j]. The matcher consumes
        the leading drafts its grammar allows (never past an EOS: the request ends there) and
        rolls them back, so it leaves as it came."""
        m = row.matcher
        n = 0
        if not (row.failed or m is None or m.is_error()):
            eos = row.eos_token_id
            n = drafts.index(eos) if eos in drafts else len(drafts)
            n = m.validate_tokens(drafts[:n]) if n else 0
        for j in range(len(drafts) + 1):
            self._fill(row, bitmask, k + j)
            if j < n:
                assert m is not None
                if not m.consume_token(drafts[j]):  # validate_tokens said it may
                    raise RuntimeError(f"the grammar refused draft {drafts[j]} it validated")
        if n:
            assert m is not None
            m.rollback(n)

    def accept(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Advance the matchers of the constrained requests among `req_ids` by their token."""
        self.accept_lists(req_ids, [[t] for t in token_ids])

    def accept_lists(self, req_ids: list[str], token_lists: list[list[int]]) -> None:
        """Advance the matchers of the constrained requests among `req_ids` by their tokens
        (a drafting request's accepted drafts, then its own token)."""
        for req_id, tokens in zip(req_ids, token_lists, strict=True):
            row = self._rows.get(req_id)
            if row is not None and row.pending is not None:
                row.resolve(req_id)
            for token in tokens:
                if not self._consume(req_id, row, token):
                    break

    def _consume(self, req_id: str, row: _Row | None, token: int) -> bool:
        """Advance `row` by one token; False where the request ends or fails there."""
        if row is None or row.failed or row.matcher is None or token < 0:
            return False
        if token == row.eos_token_id and row.matcher.is_accepting():
            return False  # the request ends here
        if not row.matcher.consume_token(token):
            logger.warning(
                "request %s: sampled token %d outside its grammar: %s",
                req_id, token, json.dumps(row.matcher.get_error()[:200]),
            )  # fmt: skip
            row.failed = True
            return False
        return True
