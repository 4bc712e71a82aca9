"""Per-hardware defaults and the GPU KV-pool sizing, checked on CPU with faked device queries.

- the token budget: 2,048 for a CPU server (vLLM's CPU default), 8,192 for a GPU server under
  160 GiB of device memory (an H100's 80 GB, an H200's 141 GB = 131 GiB), 16,384 at or above
  (a B200), twice that for the offline class;
- max_num_seqs 1,024 on cuda, 256 on cpu;
- `vx serve --device cuda` and `vx.LLM(device="cuda")` query the device (NVML first, a torch
  child process second) and the CPU path imports no torch;
- the KV pool: utilization x device memory - weights - activation peak, through
  `ModelRunner.determine_num_blocks` on a faked CUDA device (the seeds' Llama 3.1 8B on an
  80 GB H100: 27,436 blocks, 439K tokens, 107 sequences of 4,096 tokens).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

import pytest
import torch

from vx import cli
from vx.config import CacheConfig, EngineConfig, SchedulerConfig, default_max_num_batched_tokens
from vx.gpu.model_runner import ModelRunner
from vx.models_hub import device as vdev

GiB = 1024**3
H100 = 80 * 10**9  # "80 GB"
H200_NVML = 143_771 * 1024**2  # what nvidia-smi shows: 140 GiB
H200_TORCH = 150_012_035_072  # torch's total_memory: 139.7 GiB
B200 = 180 * 10**9  # 167.6 GiB


@pytest.mark.parametrize(
    ("memory", "server", "offline"),
    [
        (None, 1024, 2048),  # CPU
        (H100, 8192, 16384),
        (H200_NVML, 8192, 16384),
        (H200_TORCH, 8192, 16384),
        (160 * GiB - 1, 8192, 16384),
        (160 * GiB, 16384, 32768),
        (B200, 16384, 32768),
    ],
)
def test_token_budget_per_device_and_entry_point(memory, server, offline):
    dev = "cpu" if memory is None else "cuda"
    assert default_max_num_batched_tokens(memory, offline=False, device=dev) == server
    assert default_max_num_batched_tokens(memory, offline=True, device=dev) == offline
    kw = dict(max_num_seqs=None, max_num_batched_tokens=None, device_memory_bytes=memory)
    assert vdev.resolve_scheduler_defaults(dev, offline=False, **kw)[1] == server
    assert vdev.resolve_scheduler_defaults(dev, offline=True, **kw)[1] == offline


def test_max_num_seqs_defaults_and_explicit_values_win(monkeypatch):
    monkeypatch.setattr(vdev, "device_total_memory", lambda d: pytest.fail("queried"))
    assert vdev.resolve_scheduler_defaults(
        "cuda", max_num_seqs=None, max_num_batched_tokens=4096, offline=False
    ) == (1024, 4096)
    assert vdev.resolve_scheduler_defaults(
        "cpu", max_num_seqs=None, max_num_batched_tokens=None, offline=False
    ) == (256, 1024)
    assert vdev.resolve_scheduler_defaults(
        "cuda", max_num_seqs=12, max_num_batched_tokens=100, offline=True
    ) == (12, 100)


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.build_serve_parser(p)
    return p.parse_args(list(argv))


def test_vx_serve_cuda_queries_the_device(monkeypatch):
    asked = []

    def total(device):
        asked.append(device)
        return B200

    monkeypatch.setattr(vdev, "device_total_memory", total)
    config = cli.engine_config_from_args(_serve_args("--device", "cuda"))
    assert asked == ["cuda"]
    assert config.scheduler.max_num_batched_tokens == 16384
    assert config.scheduler.max_num_seqs == 1024
    assert not config.enforce_eager
    config = cli.engine_config_from_args(_serve_args("--device", "cuda", "--enforce-eager"))
    assert config.enforce_eager
    config = cli.engine_config_from_args(_serve_args("--max-num-batched-tokens", "1000"))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (256, 1000)
    assert asked == ["cuda", "cuda"]  # the CPU config asked nothing


def test_llm_cuda_queries_the_device_with_the_offline_budget(monkeypatch):
    import vx.llm

    monkeypatch.setattr(vdev, "device_total_memory", lambda d: H200_NVML)
    seen = {}

    class Stop(Exception):
        pass

    def resolve(config):
        seen["config"] = config
        raise Stop

    monkeypatch.setattr(vx.llm, "resolve_engine_config", resolve)
    with pytest.raises(Stop):
        vx.llm.LLM(device="cuda", enforce_eager=True)
    s = seen["config"].scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (1024, 16384)
    assert seen["config"].enforce_eager
    with pytest.raises(Stop):
        vx.llm.LLM()
    s = seen["config"].scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (256, 2048)


class _FakeNvml:
    def __init__(self, total: int, fail: str | None = None) -> None:
        self.total, self.fail, self.shutdown = total, fail, 0

    def nvmlInit_v2(self):
        return 1 if self.fail == "init" else 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle_ref):
        self.index = index.value
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, mem_ref):
        if self.fail == "mem":
            return 999
        mem_ref._obj.total = self.total
        return 0

    def nvmlShutdown(self):
        self.shutdown += 1
        return 0


def test_device_total_memory_from_nvml(monkeypatch):
    assert vdev.device_total_memory("cpu") is None
    nvml = _FakeNvml(H200_NVML)
    monkeypatch.setattr(vdev.ctypes, "CDLL", lambda name: nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    monkeypatch.setattr(vdev, "_torch_total_memory", lambda: pytest.fail("torch asked"))
    assert vdev.device_total_memory("cuda") == H200_NVML
    assert nvml.index == 3 and nvml.shutdown == 1


@pytest.mark.parametrize("fail", ["init", "mem"])
def test_device_total_memory_falls_back_to_a_torch_child(monkeypatch, fail):
    monkeypatch.setattr(vdev.ctypes, "CDLL", lambda name: _FakeNvml(0, fail=fail))
    runs = []

    def fake_run(argv, **kw):
        runs.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=f"{H200_TORCH}\n", stderr="")

    monkeypatch.setattr(vdev.subprocess, "run", fake_run)
    assert vdev.device_total_memory("cuda") == H200_TORCH
    assert len(runs) == 1 and "get_device_properties" in runs[0][-1]


def test_device_total_memory_unknown(monkeypatch):
    """No NVML and a child that fails: None (the defaults then are the small device's)."""

    def no_lib(name):
        raise OSError("no libnvidia-ml")

    monkeypatch.setattr(vdev.ctypes, "CDLL", no_lib)
    monkeypatch.setattr(
        vdev.subprocess,
        "run",
        lambda argv, **kw: subprocess.CompletedProcess(argv, 1, stdout="", stderr="no CUDA"),
    )
    assert vdev.device_total_memory("cuda") is None
    assert vdev.resolve_scheduler_defaults(
        "cuda", max_num_seqs=None, max_num_batched_tokens=None, offline=False
    ) == (1024, 8192)


def test_front_defaults_import_no_torch():
    code = (
        "import sys, argparse\n"
        "from vx import cli\n"
        "from vx.models_hub.device import resolve_scheduler_defaults\n"
        "p = argparse.ArgumentParser(); cli.build_serve_parser(p)\n"
        "c = cli.engine_config_from_args(p.parse_args([]))\n"
        "assert c.scheduler.max_num_seqs == 256, c\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"


# ───────────────────────────── KV pool sizing on a (faked) CUDA device ─────────────────────


LLAMA_8B_PARAMS = 8_030_261_248


def _cuda_runner(monkeypatch, total, in_use, peak, util=0.92, max_num_seqs=1024):
    config = EngineConfig(
        cache=CacheConfig(gpu_memory_utilization=util),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        device="cuda",
    )
    runner = ModelRunner(config, device="cuda")
    runner.model = types.SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128)
    runner.dtype = torch.bfloat16
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - in_use, total))
    monkeypatch.setattr(runner, "profile_run", lambda: peak)
    return runner


def test_determine_num_blocks_seed_example_on_cuda(monkeypatch):
    """Llama 3.1 8B bf16 on an 80 GB H100 at 0.92: at most 27,436 blocks of 2 MiB = 439K
    tokens = 107 sequences of 4,096 (the KV pool binds before max_num_seqs = 1,024 does)."""
    weights = LLAMA_8B_PARAMS * 2  # 16.06 GB
    runner = _cuda_runner(monkeypatch, H100, weights, 0)
    num, kv_bytes = runner.determine_num_blocks()
    assert num == 27_436 and kv_bytes == num * 2 * 1024**2
    assert num * 16 == 438_976 and num * 16 // 4096 == 107
    assert num * 16 // 4096 < runner.config.scheduler.max_num_seqs

    # The profiled activation peak comes off the pool too: 1 GiB is 512 blocks.
    runner = _cuda_runner(monkeypatch, H100, weights, GiB)
    assert runner.determine_num_blocks()[0] == 27_436 - 512


def test_determine_num_blocks_h200_and_nothing_left(monkeypatch):
    weights = LLAMA_8B_PARAMS * 2
    num, _ = _cuda_runner(monkeypatch, H200_TORCH, weights, 2 * GiB).determine_num_blocks()
    assert num == (int(H200_TORCH * 0.92) - weights - 2 * GiB) // (2 * 1024**2)
    with pytest.raises(RuntimeError, match="no room for one KV cache block"):
        _cuda_runner(monkeypatch, 20 * GiB, weights, 4 * GiB).determine_num_blocks()


def test_small_steps_only_for_the_cpu_server_by_default():
    sched = cli.engine_config_from_args(_serve_args()).scheduler
    assert (sched.small_step_tokens, sched.burst_step_tokens) == (192, 512)
    for args in (("--max-num-batched-tokens", "1000"), ("--small-step-tokens", "0")):
        sched = cli.engine_config_from_args(_serve_args(*args)).scheduler
        assert (sched.small_step_tokens, sched.burst_step_tokens) == (0, 0)
    given = _serve_args("--max-num-batched-tokens", "1000", "--small-step-tokens", "64")
    assert cli.engine_config_from_args(given).scheduler.small_step_tokens == 64
    offline = cli.engine_config_from_args(_serve_args(), offline=True)
    assert offline.scheduler.small_step_tokens == 0
