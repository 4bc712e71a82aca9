"""Data parallel across nodes: vLLM's flags parse into ParallelConfig, and what cannot work is
refused before anything starts (BAD_CONFIG)."""

from __future__ import annotations

import argparse

import pytest

from vx.cli import build_serve_parser, engine_config_from_args
from vx.config import EngineConfig, ParallelConfig


def _config(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    build_serve_parser(parser)
    return engine_config_from_args(parser.parse_args(["m", *flags]))


def test_flags_name_the_local_ranks_and_the_front() -> None:
    p = _config("-dp", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "2",
                "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "29551",
                "--headless").parallel  # fmt: skip
    assert (p.data_parallel_size, p.dp_local, p.data_parallel_start_rank, p.dp_remote) == (
        4, 2, 2, True,
    )
    assert (p.data_parallel_address, p.data_parallel_rpc_port) == ("10.0.0.1", 29551)
    one = _config("-dp", "2").parallel  # one node: every rank local
    assert (one.dp_local, one.dp_remote) == (2, False)


@pytest.mark.parametrize(
    "parallel, message",
    [
        (dict(data_parallel_size=2, data_parallel_size_local=3), "size-local"),
        (dict(data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=2),
         "start-rank"),
        (dict(data_parallel_size=2, data_parallel_size_local=1, data_parallel_rpc_port=0),
         "rpc-port"),
        (dict(data_parallel_size=2, nnodes=2, pipeline_parallel_size=2, master_port=29500),
         "data-parallel-size-local"),
    ],
)
def test_refused(parallel: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(parallel=ParallelConfig(**parallel)).validate()
