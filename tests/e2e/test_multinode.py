"""Two "nodes" as two `vx serve` process trees on 127.0.0.1 (gloo), PP = 2 across them: node 0
serves (front, EngineCore, stage 0's Worker), node 1 runs `--headless` (stage 1's Worker, the
driver). Greedy output through the official openai client equals HF's (fp32, tiny random
Llama); then a `kill -9` of node 1's Worker makes node 0's /health answer 503 within the step
deadline, and every process of both trees is gone within 10 s, with no /dev/shm segment left.
A headless node exits 0 after node 0's ordered shutdown, and 3 when node 0's front is lost.

Data parallel across the two "nodes" (DP = 2, one rank each): node 0 serves (the front and
rank 0), node 1 runs `--headless --data-parallel-start-rank 1` (rank 1's EngineCore and Worker,
joined to the front over a Link). Greedy parity through the official client with requests on
both ranks; then a `kill -9` of node 1's EngineCore fails the front (/health 503, exit 3), its
open stream ends with the error, and every process of both trees is gone within 10 s.
"""

from __future__ import annotations

import contextlib
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


class TwoNodes:
    """Node 0 (a VxServer: the front) and node 1 (`vx serve --headless`, its log in a file)."""

    def __init__(self, node0: VxServer, node1: subprocess.Popen, log1: str) -> None:
        self.node0, self.node1, self.log1 = node0, node1, log1
        self.tree1: list[int] = [node1.pid]

    def everyone(self) -> set[int]:
        return set(self.node0.pids) | set(self.tree1)

    def node1_log(self) -> str:
        with open(self.log1, "rb") as f:
            return f.read().decode(errors="replace")


@contextlib.contextmanager
def two_nodes(model: str, group: list[str], node0: list[str], node1: list[str]):
    """Start node 1 (`group` + `node1` + `--headless`), then node 0 (`group` + `node0`), ready;
    on exit SIGKILL whatever of either tree is left and remove node 1's log, and node 0's
    unless the test failed (as `VxServer` keeps a failed server's)."""
    log1 = open(f"/tmp/vx-e2e-node1-{os.getpid()}-{free_port()}.log", "wb")
    proc1 = subprocess.Popen(
        [sys.executable, "-m", "vx", "serve", model, "--num-threads", "1", *group, *node1,
         "--headless"],
        stdout=log1, stderr=subprocess.STDOUT,
    )  # fmt: skip
    nodes = TwoNodes(
        VxServer(model, "--served-model-name", "tiny", "--dtype", "float32", *group, *node0),
        proc1, log1.name,
    )  # fmt: skip
    failed = True
    try:
        nodes.node0.__enter__()
        nodes.tree1 += descendants(proc1.pid)
        yield nodes
        failed = False
    finally:
        for p in nodes.everyone():
            if alive(p):
                os.kill(p, signal.SIGKILL)
        proc1.wait(10)
        nodes.node0._clean_up()
        log1.close()
        os.unlink(log1.name)
        if not failed:
            os.unlink(nodes.node0.log_path)


def assert_group_fails(nodes: TwoNodes, t0: float, exit_code: int | None) -> tuple[float, float]:
    """After a loss at `t0`: node 0's /health is 503 within the step deadline, every process of
    both trees is gone within 10 s, both nodes exit non-zero (`exit_code` where given), and no
    /dev/shm segment is left. Returns the seconds to the 503 and to the last exit."""
    node0 = nodes.node0
    assert poll(lambda: _health(node0.url) != 200, STEP_TIMEOUT_S), node0.log()
    t_503 = time.monotonic() - t0
    everyone = nodes.everyone()
    assert poll(lambda: not any(alive(p) for p in everyone), 10.0), (
        [p for p in everyone if alive(p)], node0.log(),
    )
    t_gone = time.monotonic() - t0
    assert node0.proc is not None
    codes = (node0.proc.wait(1), nodes.node1.wait(1))
    assert all(c != 0 for c in codes) and exit_code in (None, *codes), (codes, node0.log())
    if exit_code is not None:
        assert codes == (exit_code, exit_code), codes
    assert not shm_of(everyone)
    return t_503, t_gone


def _pp_group() -> list[str]:
    port = free_port()  # torch.distributed's store; node 0's link listens on port + 1
    return ["-pp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]


def _dp_group() -> list[str]:
    return ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(free_port())]  # fmt: skip


def _group(mode: str) -> tuple[list[str], list[str], list[str]]:
    """(both nodes' flags, node 0's, node 1's) for PP = 2 or DP = 2 over two nodes."""
    if mode == "pp":
        return _pp_group(), ["--node-rank", "0"], ["--node-rank", "1"]
    return _dp_group(), [], ["--data-parallel-start-rank", "1"]


def _reference(model: str) -> list[str]:
    from transformers import AutoTokenizer

    from tests.e2e.test_llm import hf_greedy

    tok = AutoTokenizer.from_pretrained(model)
    return [tok.decode(ids, skip_special_tokens=True)
            for ids in hf_greedy(model, PROMPTS, NEW_TOKENS)]  # fmt: skip


def test_two_nodes_parity_then_node_loss_fails_the_group(tiny_model: str) -> None:
    reference = _reference(tiny_model)
    with two_nodes(tiny_model, _pp_group(), ["--step-timeout", str(STEP_TIMEOUT_S),
                   "--node-rank", "0"], ["--node-rank", "1"]) as nodes:  # fmt: skip
        assert _greedy_texts(nodes.node0.url) == reference, nodes.node0.log()
        # kill -9 node 1's Worker (node 1's only child: its Worker)
        workers = [p for p in descendants(nodes.node1.pid) if "spawn_main" in _cmdline(p)
                   and "resource_tracker" not in _cmdline(p)]  # fmt: skip
        assert len(workers) == 1, workers
        t0 = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        t_503, t_gone = assert_group_fails(nodes, t0, exit_code=None)
    logging.getLogger(__name__).info(
        "node loss: /health 503 after %.2f s, every process gone after %.2f s", t_503, t_gone
    )


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_a_headless_node_tells_a_lost_front_from_a_clean_shutdown(tiny_model: str, mode: str) -> None:
    """Node 0's SIGTERM (an ordered shutdown) ends node 1 with 0; a SIGKILL of node 0's front
    alone ends node 1 with 3 (ENGINE_DEAD) and a line naming the lost front. With PP, node 0's
    EngineCore still tells node 1's Worker to stop when its front is gone: only the Link's end
    (no goodbye) tells node 1 that the group failed."""
    lost = {"pp": "lost node 0 (the front)", "dp": "lost the front"}[mode]
    # DP's ordered end (the front's LinkEnd says goodbye) is tests/ipc/test_link_end.py's
    for kill in (False, True) if mode == "pp" else (True,):
        group, node0, node1 = _group(mode)
        with two_nodes(tiny_model, group, node0, node1) as nodes:
            assert nodes.node0.proc is not None
            if kill:
                os.kill(nodes.node0.proc.pid, signal.SIGKILL)  # the front only
            else:
                assert len(_greedy_texts(nodes.node0.url)) == len(PROMPTS)
                assert nodes.node0.stop(signal.SIGTERM, timeout_s=30) == 0, nodes.node0.log()
            everyone = nodes.everyone()
            assert poll(lambda e=everyone: not any(alive(p) for p in e), 10.0), (
                [p for p in everyone if alive(p)], nodes.node1_log()[-3000:],
            )
            assert nodes.node1.wait(1) == (3 if kill else 0), nodes.node1_log()[-3000:]
            assert (lost in nodes.node1_log()) == kill, nodes.node1_log()[-3000:]
            assert not shm_of(everyone)


def test_data_parallel_across_two_nodes_then_remote_engine_loss(tiny_model: str) -> None:
    reference = _reference(tiny_model)
    with two_nodes(tiny_model, *_group("dp")) as nodes:
        node0, tree1 = nodes.node0, nodes.tree1
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
        t_503, t_gone = assert_group_fails(nodes, t0, exit_code=3)
        # the front names the remote cause (node 1's EngineDead, sent before its Links closed)
        assert "vx-engine1" in node0.full_log() and "killed by SIGKILL" in node0.full_log()
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
