"""A replica that routers can steer: `vx serve` as a real subprocess, read the way the
Gateway API Inference Extension's endpoint picker reads it (vLLM's metric names on /metrics)
and the way llm-d's precise prefix-cache scorer does (its KV-event stream over ZMQ, decoded with
vLLM's published schema, tests/core/test_kv_events.py).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.core.test_kv_events import BlockRemoved, BlockStored, Index
from tests.e2e.server import VxServer, free_port
from tests.e2e.test_serve import metric, wait_for
from tests.models import SERVED, make_tiny_model

zmq = pytest.importorskip("zmq")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: The gauges the model-server protocol reads, under vLLM's names.
VLLM_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


BLOCK = 16
#: A pool of 12 blocks (192 tokens): the scripted requests below evict.
NUM_BLOCKS = 12


class Subscriber:
    """A router's side of the stream: a SUB socket on the replica's topic, the `Index` of the
    hashes it holds, and (parent, block tokens) -> hash from the stored events, to walk a new
    prompt's blocks the way a prefix-cache scorer does."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes) -> None:
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.replayed = 0
        self.index = Index()
        self.chain: dict[tuple[object, tuple[int, ...]], object] = {}
        self.kinds: set[str] = set()
        self.next_seq = 0

    def drain(self) -> None:
        while self.sock.poll(0):
            _topic, seq_bytes, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:  # joined late, or lost some: ask the replay socket
                self._replay()
            if seq == self.next_seq:
                self._apply(payload)

    def _replay(self) -> None:
        """vLLM's replay protocol: [b"", start seq] to the ROUTER; [b"", seq, payload] back,
        from `next_seq` on, then seq -1."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while True:
                assert dealer.poll(10_000), "no replay answer"
                _, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    return
                assert seq == self.next_seq, "the replay skipped a batch"
                self._apply(payload)
                self.replayed += 1
        finally:
            dealer.close()

    def _apply(self, payload: bytes) -> None:
        self.next_seq += 1
        for ev in self.index.apply(payload).events:
            self.kinds.add(type(ev).__name__)
            if isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    self.chain[(parent, tuple(ev.token_ids[i * BLOCK : (i + 1) * BLOCK]))] = h
                    parent = h
            else:
                assert isinstance(ev, BlockRemoved) or not ev.__struct_fields__

    def predicted_hit_tokens(self, prompt: list[int]) -> int:
        parent, hit = None, 0
        for i in range(len(prompt) // BLOCK):
            h = self.chain.get((parent, tuple(prompt[i * BLOCK : (i + 1) * BLOCK])))
            if h is None or h not in self.index.hashes:
                break
            parent, hit = h, hit + BLOCK
        return hit

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def kv_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def replay_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, kv_port: int, replay_port: int):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", **SERVED)
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{kv_port}", "replay_endpoint": f"tcp://*:{replay_port}",
              "topic": "kv-events"}  # fmt: skip
    with VxServer(model, "--served-model-name", "tiny", "--num-gpu-blocks-override",
                  str(NUM_BLOCKS), "--kv-events-config", json.dumps(events),
                  env={"VX_SERVER_DEV_MODE": "1"}) as srv:  # serves POST /reset_prefix_cache
        yield srv


def _samples(text: str) -> dict[str, float]:
    """{metric name: its value summed over its series} of one Prometheus text scrape."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_vllm_metric_names_follow_the_engine(server: VxServer) -> None:
    """Each gauge is typed `gauge`, labelled by model and engine, and equals its `vx:` twin;
    while a long request runs, running is 1 and KV usage is above 0, and both fall back."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for name in VLLM_GAUGES:
        assert f"# TYPE {name} gauge" in text, name
        assert f'{name}{{engine="0",model_name="tiny"}}' in text, name
    info = f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{NUM_BLOCKS}"}} 1.0'
    assert info in text
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 160, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        seen: list[dict[str, float]] = []

        def running() -> bool:  # keep the scrape that saw it: the request may end any time
            seen.append(_samples(httpx.get(server.url + "/metrics", timeout=5).text))
            return seen[-1]["vllm:num_requests_running"] == 1

        assert wait_for(running)
        scrape = seen[-1]
        for name in VLLM_GAUGES:  # one scrape: the twins are the same figure
            assert scrape[name] == scrape[name.replace("vllm:", "vx:")], name
        assert 0 < scrape["vllm:kv_cache_usage_perc"] < 1
        assert scrape["vllm:num_requests_waiting"] == 0
    assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 0)
    assert wait_for(lambda: metric(server.url, "vllm:kv_cache_usage_perc") == 0)


def test_kv_events_predict_the_prefix_cache(
    server: VxServer, kv_port: int, replay_port: int
) -> None:
    """A scripted sequence (a prompt, it again, three others that evict it, it again): after
    each request the subscriber's index holds as many hashes as the replica caches, and its walk
    of the next prompt's blocks predicts the replica's prefix hit exactly. The subscriber joins
    after the other test's requests: it gets their batches from the replay socket."""
    sub = Subscriber(f"tcp://127.0.0.1:{kv_port}", f"tcp://127.0.0.1:{replay_port}", b"kv-events")
    try:
        # A SUB socket sees only what is published after it joined: wait until it does.
        warm = [7] * 20
        assert wait_for(lambda: _complete(server, warm, 1) and (sub.drain() or sub.next_seq))
        assert sub.replayed > 0
        a = [11 + i % 50 for i in range(40)]  # two full blocks and a half
        others = [[60 + k + i % 30 for i in range(56)] for k in range(3)]  # three and a half
        script = [a, a, *others, a, warm]
        hits = []
        for prompt in script:
            predicted = sub.predicted_hit_tokens(prompt)
            before = _hits(server)
            assert _complete(server, prompt, 8)
            # the stats that count the hit come with the request's last output; poll to be sure
            assert wait_for(lambda p=predicted, b=before: _hits(server) - b == p), (
                _hits(server) - before,
                predicted,
            )
            hits.append(predicted)

            def synced() -> bool:
                sub.drain()
                return len(sub.index.hashes) == metric(server.url, "vx:kv_num_cached_free_blocks")

            assert wait_for(synced)
        assert hits[1] == 32 and hits[-2] < 32  # a hit, then an eviction of it
        assert sub.kinds == {"BlockStored", "BlockRemoved"}
    finally:
        sub.close()


def test_reset_prefix_cache_clears_every_index(
    server: VxServer, kv_port: int, replay_port: int
) -> None:
    """vLLM's development endpoint end to end (its refusals: tests/http): it empties the
    replica's prefix cache, the subscriber's index empties with it on the AllBlocksCleared
    event, and the prompt that hit before hits nothing."""
    sub = Subscriber(f"tcp://127.0.0.1:{kv_port}", f"tcp://127.0.0.1:{replay_port}", b"kv-events")
    try:
        a = [11 + i % 50 for i in range(40)]
        assert wait_for(lambda: _complete(server, a, 1) and (sub.drain() or sub.next_seq))
        assert wait_for(lambda: sub.drain() or len(sub.index.hashes) == _cached_free(server) > 0)
        r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200 and r.json() == {"ok": True}, r.text
        assert wait_for(lambda: sub.drain() or "AllBlocksCleared" in sub.kinds)
        assert sub.index.hashes == set() and _cached_free(server) == 0
        assert sub.predicted_hit_tokens(a) == 0
        before = _hits(server)
        assert _complete(server, a, 1)
        assert wait_for(lambda: sub.drain() or len(sub.index.hashes) == _cached_free(server) > 0)
        assert _hits(server) == before  # nothing was left to hit
    finally:
        sub.close()


def _cached_free(server: VxServer) -> float:
    return metric(server.url, "vx:kv_num_cached_free_blocks")


def _complete(server: VxServer, prompt: list[int], max_tokens: int) -> bool:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    return r.status_code == 200


def _hits(server: VxServer) -> float:
    return metric(server.url, "vx:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama", **SERVED)
    with VxServer(model, "--served-model-name", "tiny", "--data-parallel-size", "2") as srv:
        yield srv


def test_data_parallel_front_balances_by_prefix_and_load(dp_server: VxServer) -> None:
    """With two EngineCores: two prompts at once go one to each; later prompts that share a
    prompt's first blocks follow it, also where a tie would pick rank 0; six choices of one
    prompt fill its rank up to the slack (4 more than the other) and the sixth goes to the
    other rank. Which rank took what is read from each rank's prefix-cache query counter (in
    prompt tokens), so every prompt has its own length."""
    a = [11 + i % 50 for i in range(50)]
    b = [70 + i % 30 for i in range(60)]

    def queried() -> tuple[float, float]:
        text = httpx.get(dp_server.url + "/metrics", timeout=5).text
        return tuple(  # type: ignore[return-value]
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vx:prefix_cache_queries_total{") and f'engine="{i}"' in line
            )
            for i in (0, 1)
        )

    def send(prompt: list[int] | list[list[int]], expect: tuple[int, int], n: int = 1) -> None:
        before = queried()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "n": n, "temperature": 1.0,
                "seed": 1}  # fmt: skip
        r = httpx.post(dp_server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert wait_for(lambda: tuple(x - y for x, y in zip(queried(), before, strict=True)) == expect), (
            queried(), before, expect)  # fmt: skip

    send([a, b], (len(a), len(b)))  # one HTTP request: a to rank 0, then b to the other
    b2 = b[:48] + [5] * 9
    send(b2, (0, len(b2)))  # idle: a tie, but b's first blocks live on rank 1
    a2 = a[:32] + [6] * 3
    send(a2, (len(a2), 0))
    b3 = b[:32] + [9] * 7
    send(b3, (len(b3), 5 * len(b3)), n=6)  # five on rank 1, then rank 1 is 5 ahead: rank 0

    # a development endpoint: not served without VX_SERVER_DEV_MODE=1 (vLLM's gate)
    assert httpx.post(dp_server.url + "/reset_prefix_cache", timeout=5).status_code == 404
