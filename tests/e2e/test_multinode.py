"""Two "nodes" as two `vx serve` process trees on 127.0.0.1 (gloo), PP = 2 across them: node 0
serves (front, EngineCore, stage 0's Worker), node 1 runs `--headless` (stage 1's Worker, the
driver). Greedy output through the official openai client equals HF's (fp32, tiny random
Llama); then a `kill -9` of node 1's Worker makes node 0's /health answer 503 within the step
deadline, and every process of both trees is gone within 10 s, with no /dev/shm segment left.

Data parallel across the two "nodes" (DP = 2, one rank each): node 0 serves (the front and
rank 0), node 1 runs `--headless --data-parallel-start-rank 1` (rank 1's EngineCore and Worker,
joined to the front over a Link). Greedy parity through the official client with requests on
both ranks; then a `kill -9` of node 1's EngineCore fails the front (/health 503, exit 3), its
open stream ends with the error, and every process of both trees is gone within 10 s.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.server import VxServer, free_port
from tests.e2e.test_pipeline_parallel import NEW_TOKENS, PROMPTS, _greedy_texts
from tests.e2e.test_serve import metric
from tests.models import SERVED, make_tiny_model
from tests.reliability.harness import alive, descendants, poll, shm_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEP_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", num_hidden_layers=3,
                           **SERVED)  # fmt: skip


def test_two_nodes_parity_then_node_loss_fails_the_group(tiny_model: str) -> None:
    from transformers import AutoTokenizer

    from tests.e2e.test_llm import hf_greedy

    tok = AutoTokenizer.from_pretrained(tiny_model)
    reference = [tok.decode(ids, skip_special_tokens=True)
                 for ids in hf_greedy(tiny_model, PROMPTS, NEW_TOKENS)]  # fmt: skip
    port = free_port()  # torch.distributed's store; node 0's link listens on port + 1
    nodes = ["-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    log1 = open(f"/tmp/vx-e2e-node1-{port}.log", "wb")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "vx", "serve", tiny_model, "--num-threads", "1", *nodes,
         "--node-rank", "1", "--headless"],
        stdout=log1, stderr=subprocess.STDOUT,
    )  # fmt: skip
    node0 = VxServer(tiny_model, "--served-model-name", "tiny", "--dtype", "float32",
                     "--step-timeout", str(STEP_TIMEOUT_S), *nodes, "--node-rank", "0")  # fmt: skip
    tree1: list[int] = [node1.pid]
    try:
        node0.__enter__()
        tree1 += descendants(node1.pid)
        assert _greedy_texts(node0.url) == reference, node0.log()
        # kill -9 node 1's Worker (node 1's only child: its Worker)
        workers = [p for p in descendants(node1.pid) if "spawn_main" in _cmdline(p)
                   and "resource_tracker" not in _cmdline(p)]  # fmt: skip
        assert len(workers) == 1, workers
        t0 = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        assert poll(lambda: _health(node0.url) != 200, STEP_TIMEOUT_S), node0.log()
        t_503 = time.monotonic() - t0
        everyone = set(node0.pids) | set(tree1)
        assert poll(lambda: not any(alive(p) for p in everyone), 10.0), (
            [p for p in everyone if alive(p)], node0.log(),
        )
        t_gone = time.monotonic() - t0
        assert node0.proc is not None and node0.proc.wait(1) != 0
        assert node1.wait(1) != 0
        assert not shm_of(everyone)
    finally:
        for p in [*node0.pids, *tree1]:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        node1.wait(10)
        node0._clean_up()
        log1.close()
        os.unlink(log1.name)
    logging.getLogger(__name__).info(
        "node loss: /health 503 after %.2f s, every process gone after %.2f s", t_503, t_gone
    )


def test_data_parallel_across_two_nodes_then_remote_engine_loss(tiny_model: str) -> None:
    from transformers import AutoTokenizer

    from tests.e2e.test_llm import hf_greedy

    tok = AutoTokenizer.from_pretrained(tiny_model)
    reference = [tok.decode(ids, skip_special_tokens=True)
                 for ids in hf_greedy(tiny_model, PROMPTS, NEW_TOKENS)]  # fmt: skip
    dp = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", str(free_port())]  # fmt: skip
    log1 = open(f"/tmp/vx-e2e-dpnode1-{os.getpid()}.log", "wb")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "vx", "serve", tiny_model, "--num-threads", "1", *dp,
         "--data-parallel-start-rank", "1", "--headless"],
        stdout=log1, stderr=subprocess.STDOUT,
    )  # fmt: skip
    node0 = VxServer(tiny_model, "--served-model-name", "tiny", "--dtype", "float32", *dp)
    tree1: list[int] = [node1.pid]
    try:
        node0.__enter__()
        tree1 += descendants(node1.pid)
        assert _greedy_texts(node0.url) == reference, node0.log()
        # the balancer sent the concurrent requests to both ranks
        for engine in ("0", "1"):
            assert metric(node0.url, "vx:prefix_cache_queries_total", engine=engine) > 0, engine
        engine_pids = httpx.get(node0.url + "/version", timeout=5).json()["engine_pids"]
        assert len(engine_pids) == 2 and engine_pids[1] in tree1, (engine_pids, tree1)
        body = {"model": "tiny", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=node0.url, timeout=30) as http, \
                http.stream("POST", "/v1/completions", json={**body, "prompt": [3, 4]}) as a:
            lines_a = a.iter_lines()
            next(lines_a)  # running on rank 0: the next request goes to the idle rank 1
            with http.stream("POST", "/v1/completions", json={**body, "prompt": [5, 6]}) as b:
                lines_b = b.iter_lines()
                next(lines_b)  # running on node 1's EngineCore
                # stopped first, so that its stream is surely open when it dies
                os.kill(engine_pids[1], signal.SIGSTOP)
                t0 = time.monotonic()
                os.kill(engine_pids[1], signal.SIGKILL)  # node 1's EngineCore
                rest_b = "\n".join(lines_b)
            assert "engine dead" in rest_b and rest_b.rstrip().endswith("[DONE]"), rest_b[-500:]
        assert poll(lambda: _health(node0.url) != 200, STEP_TIMEOUT_S), node0.log()
        t_503 = time.monotonic() - t0
        everyone = set(node0.pids) | set(tree1)
        assert poll(lambda: not any(alive(p) for p in everyone), 10.0), (
            [p for p in everyone if alive(p)], node0.log(),
        )
        t_gone = time.monotonic() - t0
        assert node0.proc is not None and node0.proc.wait(1) == 3, node0.log()
        assert node1.wait(1) == 3
        # the front names the remote cause (node 1's EngineDead, sent before its Links closed)
        assert "vx-engine1" in node0.full_log() and "killed by SIGKILL" in node0.full_log()
        assert not shm_of(everyone)
    finally:
        for p in [*node0.pids, *tree1]:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        node1.wait(10)
        node0._clean_up()
        log1.close()
        os.unlink(log1.name)
    logging.getLogger(__name__).info(
        "remote DP rank loss: /health 503 after %.2f s, every process gone after %.2f s",
        t_503, t_gone,
    )


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=1).status_code
    except httpx.HTTPError:
        return 0  # the front is gone: not healthy either


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""
