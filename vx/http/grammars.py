"""GrammarChecker: compiles each new output constraint before admission, off the event loop,
within a time limit, so that a grammar that fails never reaches the engine.

Runs in: the ApiServer process. A request with a constraint waits here (the front's WAITING
for its grammar) while every admitted request keeps stepping: the compile runs on a worker
thread (llguidance drops the GIL) under `anyio.fail_after(timeout_s)`. A grammar that fails to
compile, or takes longer than `--structured-outputs-timeout`, is a 400 naming the problem.

Invariant: a grammar text is compiled at most once per process while it stays in the cache
(`vx.grammar.GrammarCache`, keyed by the hash of grammar text + tokenizer); a hit costs a hash.
A compile that timed out is abandoned, not killed: llguidance's own limits end it (a schema too
large fails in about 100 ms), and its result is cached for the next request.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from vx.grammar import GrammarCache, GrammarError, fingerprint_of, grammar_of, load_ll_tokenizer
from vx.http.errors import APIError
from vx.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from vx.http.metrics import Metrics
    from vx.http.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: `--structured-outputs-timeout`'s default, seconds.
DEFAULT_TIMEOUT_S = 5.0


class GrammarChecker:
    """The ApiServer's grammar cache for its tokenizer (built on first use, about 0.2 s)."""

    def __init__(
        self, tokenizer: Tokenizer, metrics: Metrics, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._tokenizer = tokenizer
        self._metrics = metrics
        self.timeout_s = timeout_s
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()

    def prepare(self) -> GrammarChecker:
        """Build the cache's tokenizer on a daemon thread now, so the first constrained
        request finds it ready; returns self."""
        def build() -> None:
            try:
                self._get_cache()
            except GrammarError as e:
                logger.warning("%s", e)

        threading.Thread(target=build, name="grammar-tokenizer", daemon=True).start()
        return self

    def _get_cache(self) -> GrammarCache:
        """The cache; `GrammarError` where llguidance cannot read this tokenizer."""
        with self._lock:
            if self._cache is None:
                text = self._tokenizer.backend.to_str()
                eos = list(self._tokenizer.eos_token_ids)
                vocab = self._tokenizer.vocab_size
                try:
                    tok = load_ll_tokenizer(text, vocab_size=vocab, eos_token_ids=eos)
                except Exception as e:  # llguidance raises plain ValueErrors and RuntimeErrors
                    raise GrammarError(f"structured outputs are unavailable for this "
                                       f"model's tokenizer: {e}") from None  # fmt: skip
                self._cache = GrammarCache(tok, fingerprint_of(text, vocab, eos))
            return self._cache

    async def check(self, spec: StructuredOutputsParams, param: str) -> None:
        """Return once `spec` compiles; a 400 APIError (`param` named) when it cannot."""
        self._metrics.structured_requests.inc()
        try:
            text = grammar_of(spec)
        except GrammarError as e:
            self._fail("invalid", f"the output constraint is invalid: {e}", param)
        try:
            cache = self._cache or await anyio.to_thread.run_sync(self._get_cache)
        except GrammarError as e:
            self._fail("invalid", str(e), param)
        try:
            if cache.check(text):
                return
        except GrammarError as e:
            self._fail("invalid", f"the output constraint does not compile: {e}", param)
        t0 = time.perf_counter()
        try:
            with anyio.fail_after(self.timeout_s):
                await anyio.to_thread.run_sync(cache.matcher, text, abandon_on_cancel=True)
        except TimeoutError:
            self._fail(
                "timeout",
                f"the output constraint did not compile within {self.timeout_s:g} s "
                "(--structured-outputs-timeout); simplify the schema or grammar",
                param,
            )
        except GrammarError as e:
            self._fail("invalid", f"the output constraint does not compile: {e}", param)
        self._metrics.grammar_compile.observe(time.perf_counter() - t0)

    def _fail(self, cause: str, message: str, param: str) -> None:
        self._metrics.grammar_failure(cause)
        raise APIError(400, message, param=param, code="invalid_grammar")
