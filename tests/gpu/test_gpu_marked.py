"""Checks that need CUDA (marked `gpu`; tests/conftest.py skips them where CUDA is missing).

Run them with `pytest -m gpu tests/gpu/test_gpu_marked.py` (bench/gpu_check.sh does). They
cover what the CPU tests cannot: the compiled Triton kernels at real head sizes in bf16 and
fp16, the model's CUDA path actually calling them, captured CUDA graphs against eager steps,
and the profiled KV-pool sizing on a real device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu.test_cuda_graphs import _Sim
from tests.models import make_tiny_model
from vx.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from vx.gpu.attention.paged import build_attention_metadata
from vx.gpu.cuda_graphs import CudaGraphRunner, cudagraph_capture_sizes
from vx.gpu.model_runner import ModelRunner

pytestmark = pytest.mark.gpu
BS = 16


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    # tests/gpu/test_triton.py sets TRITON_INTERPRET=1 for its own CPU runs; not here.
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gpu"), "llama")


def _paged(reqs, hkv, d, dtype, seed=0, device="cuda"):
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    nblocks = [-(-(nc + n) // BS) for nc, n in reqs]
    num_blocks = sum(nblocks) + 5
    perm = rng.permutation(num_blocks)
    bt = np.zeros((len(reqs), max(nblocks) + 2), np.int32)
    off = 0
    for i, nb in enumerate(nblocks):
        bt[i, :nb] = perm[off : off + nb]
        off += nb
    slots = np.concatenate(
        [
            bt[i, np.arange(nc, nc + n) // BS] * BS + np.arange(nc, nc + n) % BS
            for i, (nc, n) in enumerate(reqs)
        ]
    )
    num_decodes = 0
    while num_decodes < len(reqs) and reqs[num_decodes][1] == 1:
        num_decodes += 1
    md = build_attention_metadata(
        query_lens=np.array([n for _, n in reqs]),
        num_computed=np.array([nc for nc, _ in reqs]),
        block_table=bt,
        slot_mapping=slots,
        num_decodes=num_decodes,
        device=device,
    )
    kc = torch.randn(hkv, num_blocks, BS, d, generator=gen, device=device).to(dtype)
    vc = torch.randn(hkv, num_blocks, BS, d, generator=gen, device=device).to(dtype)
    return md, kc, vc, gen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_paged_attention_real_sizes(dtype):
    """Llama-8B heads (32 q, 8 kv, 128): decodes up to 2K context, prefills with and without
    a cached prefix, against the torch reference on the GPU."""
    from vx.gpu.attention import triton as ta

    reqs = [(0, 1), (2047, 1), (300, 1), (15, 1), (0, 300), (517, 129), (1024, 64)]
    md, kc, vc, gen = _paged(reqs, 8, 128, dtype)
    q = torch.randn(md.num_tokens, 32, 128, generator=gen, device="cuda").to(dtype)
    out = ta.paged_attention(q, kc, vc, md, 128**-0.5)
    ref = ta.paged_attention_ref(q, kc, vc, md, 128**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_norm_rotary_kv_write(dtype):
    from vx.gpu.attention import triton as ta

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(257, 4096, generator=g, device="cuda").to(dtype)
    r = torch.randn(257, 4096, generator=g, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(4096, generator=g, device="cuda")).to(dtype)
    got, got_r = ta.rms_norm(x, w, 1e-5, r)
    want, want_r = ta.rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(got_r, want_r)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)

    inv = 1.0 / (500000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    freqs = torch.arange(8192, device="cuda").float()[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    pos = torch.randint(0, 8192, (257,), generator=g, device="cuda")
    q = torch.randn(257, 32, 128, generator=g, device="cuda").to(dtype)
    k = torch.randn(257, 8, 128, generator=g, device="cuda").to(dtype)
    wq, wk = ta.rotary_embedding_ref(pos, q, k, cos, sin)
    gq, gk = ta.rotary_embedding(pos, q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(gq, wq, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(gk, wk, atol=1e-2, rtol=1e-2)

    kc = torch.zeros(8, 64, BS, 128, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.randperm(64 * BS, device="cuda")[:257]
    slots[::7] = -1
    ta.write_kv_cache(k, k, kc, vc, slots)
    ta.write_kv_cache_ref(k, k, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_model_cuda_path_calls_triton_and_matches_cpu(tiny_llama, monkeypatch):
    from tests.gpu.conftest import PagedDriver
    from vx.gpu.attention import triton as ta
    from vx.gpu.loader import load_model

    calls = {}
    for name in ("rms_norm", "rotary_embedding", "paged_attention", "write_kv_cache"):
        real = getattr(ta, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **kw)

        monkeypatch.setattr(ta, name, spy)
    model = load_model(tiny_llama, dtype=torch.float32, device="cuda", progress=False)
    cpu = load_model(tiny_llama, dtype=torch.float32, progress=False)
    ids = torch.tensor([3, 5, 7, 9, 11, 13, 17], device="cuda")
    md, caches = _one_prefill(model, len(ids))
    hidden = model(ids, torch.arange(len(ids), device="cuda"), caches, md)
    n = model.num_layers
    assert calls == {
        "rms_norm": 2 * n + 1,
        "rotary_embedding": n,
        "paged_attention": n,
        "write_kv_cache": n,
    }
    want = PagedDriver(cpu).step_all({"x": ids.tolist()})["x"]
    torch.testing.assert_close(model.compute_logits(hidden).cpu(), want, atol=2e-2, rtol=2e-2)


def _one_prefill(model, n, device="cuda"):
    from vx.gpu.kv_cache import allocate_kv_caches

    caches = allocate_kv_caches(
        model.num_layers, 8, model.num_kv_heads, model.head_dim, dtype=model.dtype, device=device
    )
    md = build_attention_metadata(
        query_lens=np.array([n]),
        num_computed=np.array([0]),
        block_table=np.array([[3, 5]], np.int32),
        slot_mapping=3 * BS + np.arange(n),
        num_decodes=0,
        device=device,
    )
    return md, caches


def _cuda_runner(path, enforce_eager, dtype="float32", num_blocks=64):
    config = EngineConfig(
        model=ModelConfig(path=path, dtype=dtype, max_model_len=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        cache=CacheConfig(num_blocks_override=num_blocks),
        device="cuda",
        enforce_eager=enforce_eager,
    )
    config.validate()
    runner = ModelRunner(config, device="cuda")
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks()[0])
    return runner


def test_runner_cuda_graphs_match_eager(tiny_llama):
    graphs = _cuda_runner(tiny_llama, enforce_eager=False)
    eager = _cuda_runner(tiny_llama, enforce_eager=True)
    assert eager.cuda_graphs is None
    assert sorted(graphs.cuda_graphs.graphs) == cudagraph_capture_sizes(8) == [1, 2, 4, 8, 16]
    assert _Sim(graphs).run() == _Sim(eager).run()
    assert graphs.cuda_graphs.num_replays == 13


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_padded_37_in_40(tiny_llama, dtype):
    """37 decodes over random contexts, replayed in the 40 graph = the eager forward; the
    padding rows write no KV."""
    from vx.gpu.loader import load_model

    model = load_model(tiny_llama, dtype=dtype, device="cuda", progress=False)
    from vx.gpu.kv_cache import allocate_kv_caches

    caches = allocate_kv_caches(
        model.num_layers, 200, model.num_kv_heads, model.head_dim, dtype=dtype, device="cuda"
    )
    for k, v in caches:
        k.normal_()
        v.normal_()
    reqs = [(int(c), 1) for c in np.random.default_rng(0).integers(1, 70, size=37)]
    md, _, _, _ = _paged(reqs, 1, 8, dtype)  # only the metadata (blocks < 200)
    ids = torch.randint(1, 300, (37,), device="cuda")
    pos = torch.tensor([c for c, _ in reqs], device="cuda")
    runner = CudaGraphRunner(model, caches, [8, 40], 16, "cuda")
    runner.capture()
    before = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        got = runner.forward(ids, pos, caches, md).clone()
        after_graph = [(k.clone(), v.clone()) for k, v in caches]
        for (k, v), (k0, v0) in zip(caches, before, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        want = model(ids, pos, caches, md)
    assert runner.num_replays == 1
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for (gk, gv), (ek, ev) in zip(after_graph, caches, strict=True):
        torch.testing.assert_close(gk, ek, atol=tol, rtol=tol)
        torch.testing.assert_close(gv, ev, atol=tol, rtol=tol)


def test_profiled_kv_sizing_on_device(tiny_llama):
    config = EngineConfig(
        model=ModelConfig(path=tiny_llama, dtype="bfloat16", max_model_len=256),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        cache=CacheConfig(gpu_memory_utilization=0.5),
        device="cuda",
    )
    runner = ModelRunner(config, device="cuda")
    runner.load_model()
    peak = runner.profile_run()
    assert peak > 0
    num, kv_bytes = runner.determine_num_blocks()
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < kv_bytes <= 0.5 * total
    assert num == kv_bytes // runner._block_bytes()


_TP_RANK = """
import sys, torch
from safetensors.torch import save_file
from tests.gpu.test_gpu_marked import _one_prefill
from vx.config import EngineConfig, ParallelConfig
from vx.gpu.loader import load_model
from vx.gpu.worker import _init_torch, _min_across_ranks
rank, port, out, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
config = EngineConfig(device="cuda", parallel=ParallelConfig(tensor_parallel_size=2))
device = _init_torch(config, rank, rank, f"tcp://127.0.0.1:{port}")  # NCCL, and gloo for CPU
assert _min_across_ranks(100 + rank, 2) == 100  # a CPU tensor: over gloo
model = load_model(path, dtype=torch.float32, device=device, tp_rank=rank, tp_size=2,
                   progress=False)
ids = torch.tensor([3, 5, 7, 9, 11, 13, 17], device=device)
md, caches = _one_prefill(model, len(ids), device)
logits = model.compute_logits(model(ids, torch.arange(7, device=device), caches, md))
if rank == 0:
    save_file({"logits": logits.cpu()}, f"{out}/tp.safetensors")
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_over_nccl(tiny_llama, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from safetensors.torch import load_file

    from vx.gpu.loader import load_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TP_RANK, str(r), port, str(tmp_path), tiny_llama], env=env
        )
        for r in range(2)
    ]
    try:
        assert [p.wait(timeout=100) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    model = load_model(tiny_llama, dtype=torch.float32, device="cuda", progress=False)
    ids = torch.tensor([3, 5, 7, 9, 11, 13, 17], device="cuda")
    md, caches = _one_prefill(model, len(ids))
    want = model.compute_logits(model(ids, torch.arange(7, device="cuda"), caches, md)).cpu()
    got = load_file(str(tmp_path / "tp.safetensors"))["logits"]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
