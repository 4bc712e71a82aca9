"""The `vx bench serve` tests run against the HTTP tests' app (tests/http): their fixtures here."""

from tests.http.conftest import tokenizer, tokenizer_dir  # noqa: F401 (fixtures)
