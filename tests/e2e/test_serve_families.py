"""`vx serve DIR` and `vx serve FILE.gguf` for every family beyond Llama (issue 50's "Done
when"), driven by the official openai client: each family's tiny random model is served from
its HF directory and from the GGUF the `gguf` package's writer made of the same weights; both
answer a completion and a chat, and their greedy completions are the same text.
"""

from __future__ import annotations

import pytest

from tests.e2e.server import VxServer
from tests.models import make_tiny_gguf, make_tiny_model

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FAMILIES = ["qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2", "gemma3"]
#: What a GGUF can say of a family: Gemma 3's file carries no layer list, so its layers take
#: the default pattern (every 6th global), as llama.cpp's do.
GGUF_SHAPED = {"gemma3": {"layer_types": None, "num_hidden_layers": 7}}
PROMPT = "the cat sat on the mat and"


def _serve_and_ask(model: str) -> tuple[str, str]:
    """The greedy completion's text, and a chat answer's text, from `vx serve model` (fp32
    both: the GGUF's F32 tensors convert to an fp32 directory)."""
    with VxServer(model, "--served-model-name", "m", "--dtype", "float32") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60)
        done = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=12, temperature=0.0,
            logprobs=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chat = client.chat.completions.create(
            model="m",
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0.0,
        )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "length"
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == 12, choice
    return choice.text, chat.choices[0].message.content or ""


@pytest.mark.parametrize("arch", FAMILIES)
def test_serve_hf_directory_and_gguf_file(tmp_path, arch: str) -> None:
    # fp32: the GGUF writer reads the checkpoint with numpy
    hf_dir = make_tiny_model(tmp_path / "hf", arch, seed=8, **GGUF_SHAPED.get(arch, {}))
    gguf_file = make_tiny_gguf(hf_dir, str(tmp_path / f"{arch}.gguf"))
    from_dir = _serve_and_ask(hf_dir)
    from_gguf = _serve_and_ask(gguf_file)
    assert from_gguf[0] == from_dir[0]
