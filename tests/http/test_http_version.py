"""/version names every process of the engine tree: each data-parallel rank's EngineCore and
every Worker of it, one per tensor-parallel rank.

The first test drives the app on fake engines (what the front makes of EngineReady); the second
starts a real `vx serve --tensor-parallel-size 2 --data-parallel-size 2` on a tiny model, where
the pids come from the launcher through each EngineCore.
"""

from __future__ import annotations

import os

import httpx
import pytest

from tests.e2e.server import VxServer
from tests.http.conftest import running_app
from tests.models import make_tiny_model
from vx.http.tokenizer import Tokenizer


@pytest.mark.anyio
async def test_version_lists_the_workers_of_every_engine(tokenizer: Tokenizer) -> None:
    pids = [[101, 102], [201, 202]]
    async with running_app(tokenizer, num_engines=2, worker_pids=pids) as h, h.http() as c:
        version = (await c.get("/version")).json()
    assert version["worker_pids"] == [101, 102, 201, 202]
    assert len(version["engine_pids"]) == 2


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_version_lists_every_worker_of_a_tp2_dp2_server(tmp_path: os.PathLike[str]) -> None:
    model = make_tiny_model(tmp_path, arch="llama")
    args = ("--served-model-name", "tiny", "--dtype", "float32",
            "--tensor-parallel-size", "2", "--data-parallel-size", "2")  # fmt: skip
    with VxServer(model, *args) as server:
        version = httpx.get(server.url + "/version", timeout=10).json()
        workers, engines = version["worker_pids"], version["engine_pids"]
        assert len(workers) == 4 and len(set(workers)) == 4, version
        assert len(engines) == 2 and not set(engines) & set(workers), version
        # Every one is a live child of the server (the launcher spawns the whole tree).
        assert set(workers) | set(engines) <= set(server.pids), (version, server.pids)
        for pid in workers:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split(")")[-1].split()[0] != "Z", pid
