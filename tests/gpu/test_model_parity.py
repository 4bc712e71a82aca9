"""vx's Llama-family model over the real paged attention vs HF transformers.

Tiny random Llama / Qwen2 / Mistral models (and SmolLM2-135M itself, through the
`smollm2-135m` alias) must give the same greedy tokens as HF in fp32, prefill and decode
through the paged KV cache, and agree on >= 99% of top-1 tokens in bf16.
"""

from __future__ import annotations

import inspect
import os
import socket

import pytest
import torch

from tests.gpu.conftest import PagedDriver
from tests.models import make_tiny_model
from vx.gpu.loader import iterate_weights, load_model, resolve_dtype
from vx.gpu.models import get_model_class

PROMPTS = {
    "short": [5, 6, 7, 8, 9, 10, 11],
    "long": list(range(20, 61)),  # 41 tokens: crosses two block boundaries
    "one": [3],
    "repeat": [100, 101, 102] * 6,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so the 8 frequencies of head_dim 16 span all three llama3 regimes
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2-mha-3layers": ("qwen2", {"num_key_value_heads": 4, "num_hidden_layers": 3}),
}


def hf_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """HF greedy decoding with its own KV cache (no eos stop)."""
    from transformers import DynamicCache

    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    cache = DynamicCache()
    logits = hf(torch.tensor([prompt]), use_cache=True, **{cache_kw: cache}).logits
    out = [int(logits[0, -1].argmax())]
    for _ in range(n - 1):
        logits = hf(torch.tensor([[out[-1]]]), use_cache=True, **{cache_kw: cache}).logits
        out.append(int(logits[0, -1].argmax()))
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides = VARIANTS[request.param]
    seed = list(VARIANTS).index(request.param)
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=seed, **overrides)


def test_tiny_greedy_matches_hf_fp32(variant: str) -> None:
    model = load_model(variant, dtype=torch.float32, progress=False)
    hf = hf_model(variant, torch.float32)
    got = PagedDriver(model).greedy(PROMPTS, 16)
    for req_id, prompt in PROMPTS.items():
        assert got[req_id] == hf_greedy(hf, prompt, 16), req_id
    # and the prefill logits themselves agree closely
    logits = PagedDriver(model).step({"x": PROMPTS["long"]})["x"]
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS["long"]])).logits[0, -1]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_equals_one_shot(tiny_models: dict[str, str]) -> None:
    model = load_model(tiny_models["llama"], dtype=torch.float32, progress=False)
    prompt = PROMPTS["long"]
    one_shot = PagedDriver(model).step({"a": prompt})["a"]
    d = PagedDriver(model, seed=1)
    d.step({"b": PROMPTS["short"]})
    d.step({"a": prompt[:5], "b": [12]})  # a chunk beside a decode
    d.step({"a": prompt[5:23], "b": [13]})  # a chunk with a cached prefix, across a block edge
    chunked = d.step({"b": [14], "a": prompt[23:]})["a"]
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)


def test_tiny_bf16_agrees_with_hf(tiny_models: dict[str, str]) -> None:
    path = tiny_models["qwen2"]
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    hf = hf_model(path, torch.bfloat16)
    got = PagedDriver(model).greedy(PROMPTS, 16)
    agree = sum(
        a == b
        for r, p in PROMPTS.items()
        for a, b in zip(got[r], hf_greedy(hf, p, 16), strict=True)
    )
    assert agree / (16 * len(PROMPTS)) >= 0.9


def test_cpu_prepacked_bf16_equals_plain(tiny_models: dict[str, str], monkeypatch) -> None:
    """Prepacked bf16 weights (oneDNN's layout, or vx's VNNI copy on AVX512-BF16 without AMX)
    give the same logits as plain F.linear at decode sizes."""
    from vx.gpu.layers.linear import cpu_prepack_enabled

    path = tiny_models["qwen2"]  # qkv bias goes through the packed path too
    packed = load_model(path, dtype=torch.bfloat16, progress=False)
    if not cpu_prepack_enabled(torch.empty(1, dtype=torch.bfloat16)):
        pytest.skip("no oneDNN bf16 on this CPU")
    down = packed.model.layers[0].mlp.down_proj
    assert down.weight.is_mkldnn or down.vnni is not None
    monkeypatch.setenv("VX_CPU_PREPACK", "0")
    plain = load_model(path, dtype=torch.bfloat16, progress=False)
    down = plain.model.layers[0].mlp.down_proj
    assert not down.weight.is_mkldnn and down.vnni is None
    a, b = PagedDriver(packed), PagedDriver(plain)
    batch = {"a": PROMPTS["short"], "b": PROMPTS["repeat"]}
    for _ in range(4):
        la, lb = a.step(batch), b.step(batch)
        for r in batch:
            torch.testing.assert_close(la[r], lb[r], atol=0.05, rtol=0.02)
        batch = {r: [int(la[r].argmax())] for r in batch}


def test_iterate_weights_reads_what_safetensors_wrote(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d": torch.randn(2, 2).half(),
        "e": torch.zeros(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = dict(iterate_weights(str(tmp_path), progress=False))
    want = load_file(str(tmp_path / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_resolve_dtype() -> None:
    from transformers import LlamaConfig

    cfg = {d: LlamaConfig(dtype=d) for d in ("bfloat16", "float16", "float32")}
    assert resolve_dtype("auto", cfg["bfloat16"], "cpu") is torch.bfloat16
    assert resolve_dtype("auto", cfg["float16"], "cpu") is torch.bfloat16
    assert resolve_dtype("auto", cfg["float32"], "cpu") is torch.float32
    assert resolve_dtype("auto", cfg["float16"], "cuda") is torch.float16
    assert resolve_dtype("float16", cfg["float32"], "cpu") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", cfg["float32"], "cpu")


def test_registry_and_weight_errors(tiny_models: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    model = load_model(tiny_models["llama"], dtype=torch.float32, progress=False)
    w = torch.zeros(4)
    with pytest.raises(ValueError, match="unexpected weight"):
        model.load_weights([("model.layers.0.mlp.nope.weight", w)])
    with pytest.raises(ValueError, match="missing"):
        model.load_weights([])
    assert (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (2, 4, 2, 16)


# ───────────────────────────── tensor parallel ─────────────────────────────


def _two_steps(model: torch.nn.Module) -> torch.Tensor:
    """Logits of a prefill step (two requests) and a decode step, stacked [4, vocab]."""
    d = PagedDriver(model)
    first = d.step({"a": PROMPTS["long"], "b": PROMPTS["short"]})
    second = d.step({"a": [7], "b": [9]})
    return torch.stack([first["a"], first["b"], second["a"], second["b"]])


_TP_RANK = """
import os, sys, torch, torch.distributed as dist
from safetensors.torch import save_file
from tests.gpu.test_model_parity import _two_steps
from vx.gpu.loader import load_model
rank, port, out, paths = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
for i, path in enumerate(paths):
    model = load_model(path, dtype=torch.float32, tp_rank=rank, tp_size=2, progress=False)
    logits = _two_steps(model)
    if rank == 0:
        save_file({"logits": logits}, f"{out}/{i}.safetensors")
# gloo's teardown can abort ("terminate called without an active exception") when the peer
# closes its sockets first; meet at a barrier, then leave without tearing the group down.
dist.barrier()
os._exit(0)
"""


def test_tensor_parallel_2_matches_tp_1(tmp_path) -> None:
    """Two gloo ranks (subprocesses) give the TP=1 logits: sharded linears, replicated KV
    heads, a padded vocab split and a tied head."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    paths = [
        make_tiny_model(tmp_path / "a", "qwen2", seed=7),  # 2 kv heads: one per rank
        # 1 kv head, replicated on both ranks; vocab 385 is padded to 386 across ranks; tied
        make_tiny_model(
            tmp_path / "b", "llama", seed=8, num_key_value_heads=1, vocab_size=385,
            tie_word_embeddings=True,
        ),
        # the families of issue 50: Phi-3's fused checkpoint cut per rank, Gemma 2's windowed
        # and soft-capped attention over a rank's heads, Qwen3-MoE's slices of every expert
        make_tiny_model(tmp_path / "c", "phi3", seed=9),
        make_tiny_model(tmp_path / "d", "gemma2", seed=10),
        make_tiny_model(tmp_path / "e", "qwen3_moe", seed=11),
    ]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TP_RANK, str(rank), port, str(tmp_path), *paths], env=env
        )
        for rank in range(2)
    ]
    try:
        assert [p.wait(timeout=100) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    for i, path in enumerate(paths):
        want = _two_steps(load_model(path, dtype=torch.float32, progress=False))
        got = load_file(str(tmp_path / f"{i}.safetensors"))["logits"]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ───────────────────────────── SmolLM2-135M (the real default model) ─────────────────────────────

SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5, 6,",
    "Translate to French: The weather is nice today.",
    "The three primary colors are",
]
SMOLLM2_CHATS = [
    "What is the boiling point of water in Celsius?",
    "Write a haiku about autumn leaves.",
]
NEW_TOKENS = 64
# The SmolLM2 tests take about 10 s each on an idle 2-core machine and several times that
# when the cores are shared, so they get their own timeout; the download and conversion (once
# per cache) add about 20 s to the first.
SMOLLM2_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def smollm2() -> str:
    """The converted SmolLM2 dir; $VX_CACHE (or ~/.cache/vx) keeps it across runs."""
    from vx.models_hub.resolve import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2: str) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = {f"p{i}": tok(p)["input_ids"] for i, p in enumerate(SMOLLM2_PROMPTS)}
    for i, q in enumerate(SMOLLM2_CHATS):
        msgs = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts[f"c{i}"] = tok(text, add_special_tokens=False)["input_ids"]
    return prompts


@torch.no_grad()
def hf_argmax_along(hf: torch.nn.Module, prompt: list[int], continuation: list[int]) -> list[int]:
    """HF's top-1 after the prompt and after each continuation token but the last (one forward).

    If this equals `continuation`, then `continuation` is exactly HF's greedy output: each token
    is HF's argmax given everything before it.
    """
    seq = prompt + continuation[:-1]
    return hf(torch.tensor([seq])).logits[0, len(prompt) - 1 :].argmax(-1).tolist()


@pytest.mark.slow
@pytest.mark.timeout(SMOLLM2_TIMEOUT_S)
def test_smollm2_greedy_matches_hf_fp32(smollm2, smollm2_prompts) -> None:
    model = load_model(smollm2, dtype=torch.float32, progress=False)
    ours = PagedDriver(model, num_blocks=128).greedy(smollm2_prompts, NEW_TOKENS)
    del model
    hf = hf_model(smollm2, torch.float32)
    for req_id, prompt in smollm2_prompts.items():
        assert hf_argmax_along(hf, prompt, ours[req_id]) == ours[req_id], req_id


@pytest.mark.slow
@pytest.mark.timeout(SMOLLM2_TIMEOUT_S)
def test_smollm2_bf16_top1_agreement(smollm2, smollm2_prompts) -> None:
    """vx bf16 vs HF bf16, teacher-forced on vx's own bf16 greedy continuation (512 positions),
    through three paths: one request per step (HF's shapes), 8 prefills in one flat step, and
    8 decodes per step through the paged decode attention.

    bf16 results depend on GEMM shapes and packing (fp32 accumulation order before the bf16
    rounding) and bf16 logits tie or sit one ulp apart often (1 ulp is 0.125 at 20). So:
    top-1 agreement within one bf16 ulp of HF's top logit >= 99% on every path, and exact
    argmax agreement >= 97%: HF bf16 decoding with its own KV cache picks HF bf16 full
    forward's argmax at only 497 of these 512 positions (97.1%), so exact ties beyond that are
    rounding, not error. (vx: 501-505 exact, 511-512 within one ulp.)
    """
    model = load_model(smollm2, dtype="auto", progress=False)
    assert model.dtype is torch.bfloat16  # config.json says bfloat16; auto on CPU keeps it
    ours = PagedDriver(model, num_blocks=128).greedy(smollm2_prompts, NEW_TOKENS)
    full = {r: p + ours[r][:-1] for r, p in smollm2_prompts.items()}
    batched = PagedDriver(model, num_blocks=128).step_all(full)
    alone = {r: PagedDriver(model, num_blocks=16).step_all({r: seq})[r] for r, seq in full.items()}
    del model
    hf = hf_model(smollm2, torch.bfloat16)
    exact = {"alone": 0, "batched": 0, "decode": 0}
    within_ulp = dict(exact)
    for req_id, prompt in smollm2_prompts.items():
        n = len(prompt) - 1
        with torch.no_grad():
            theirs = hf(torch.tensor([full[req_id]])).logits[0, n:]  # bf16 [64, vocab]
        best = theirs.max(-1).values
        ulp = (best.float().abs() * 2.0**-7).to(best.dtype)  # bf16 keeps 8 significant bits
        picks = {
            "alone": alone[req_id][n:].argmax(-1),
            "batched": batched[req_id][n:].argmax(-1),
            "decode": torch.tensor(ours[req_id]),
        }
        for path, tokens in picks.items():
            exact[path] += int((tokens == theirs.argmax(-1)).sum())
            ours_logit = theirs.gather(1, tokens[:, None])[:, 0]
            within_ulp[path] += int((ours_logit >= best - ulp).sum())
    total = NEW_TOKENS * len(smollm2_prompts)
    report = f"exact {exact}, within one ulp {within_ulp}, of {total}"
    assert min(within_ulp.values()) / total >= 0.99, report
    assert min(exact.values()) / total >= 0.97, report
