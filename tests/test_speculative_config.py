"""`--speculative-config` (vLLM's JSON keys) into `SpeculativeConfig`, and what validation
refuses."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from vx import cli
from vx.config import EngineConfig, SchedulerConfig, SpeculativeConfig, parse_speculative_config


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.build_serve_parser(p)
    return p.parse_args(list(argv))


def test_serve_flag_turns_drafts_on_and_keeps_async_scheduling() -> None:
    config = cli.engine_config_from_args(
        _args("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    )
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert config.speculative.enabled and config.scheduler.async_scheduling
    config.validate()
    sync = cli.engine_config_from_args(
        _args("--speculative-config", '{"method": "ngram"}', "--no-async-scheduling")
    )
    assert sync.speculative.enabled and not sync.scheduler.async_scheduling
    off = cli.engine_config_from_args(_args())
    assert not off.speculative.enabled and off.scheduler.async_scheduling


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "ngram", "lookahead": 3}', "unknown keys"),
        ("[1, 2]", "a JSON object"),
        ("{method: ngram}", "malformed"),
        ('{"method": "ngram", "num_speculative_tokens": "four"}', "Expected `int`"),
    ],
)
def test_bad_json_is_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="bad --speculative-config") as e:
        parse_speculative_config(text)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "eagle"}, "unknown speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"in \[1, 16\]"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "takes a \"model\""),
        ({"method": "ngram", "model": "m"}, "takes a \"model\""),
    ],
)
def test_validation_names_the_problem(spec: dict, message: str) -> None:
    config = EngineConfig(
        scheduler=SchedulerConfig(async_scheduling=False),
        speculative=parse_speculative_config(spec),
    )
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_cuda_is_refused() -> None:
    spec = SpeculativeConfig(method="ngram")
    config = EngineConfig(speculative=spec)
    config.validate()
    with pytest.raises(ValueError, match="CPU only"):
        msgspec.structs.replace(config, device="cuda").validate()
