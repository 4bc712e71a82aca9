"""The ApiServer's tokenizer: HF `tokenizer.json` through `tokenizers`, chat templates through jinja2.

Runs in: the ApiServer process. It loads the Rust `tokenizers.Tokenizer` directly rather than
`transformers.AutoTokenizer`, because transformers imports torch, and the front must stay light
(and must never compete with the workers for the CPU cores). `apply_chat_template` follows HF's
rendering rules (sandboxed jinja2, `trim_blocks`, `lstrip_blocks`, loop controls, `tojson`,
`raise_exception`, `strftime_now`) so templates written for HF render the same text. Only a
model directory without `tokenizer.json` (a slow, sentencepiece-only tokenizer) falls back to
transformers, once, at start-up, to convert it.
"""

from __future__ import annotations

import datetime
import json
import logging
import pathlib
from collections.abc import Sequence
from typing import Any

import anyio.to_thread
from tokenizers import Tokenizer as _RustTokenizer

logger = logging.getLogger(__name__)

#: Texts longer than this are tokenized on a worker thread, so the event loop stays responsive.
THREAD_ENCODE_CHARS = 8192


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (an HTTP 400)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, used by ByteLevel vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _token_content(value: object) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """A loaded tokenizer with the model's special ids and chat template.

    Invariant: `eos_token_ids` is every id that ends generation for this model (the tokenizer's
    EOS plus `generation_config.json`'s list), `eos_token_id` is the first of them or None.
    """

    def __init__(
        self,
        backend: _RustTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        model_max_length: int | None = None,
    ) -> None:
        self._tok = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        eos_ids: list[int] = []
        if eos_token is not None and (i := backend.token_to_id(eos_token)) is not None:
            eos_ids.append(i)
        eos_ids.extend(i for i in extra_eos_token_ids if i not in eos_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
        self._byte_level = "ByteLevel" in kinds
        self._template: Any = None

    @property
    def backend(self) -> _RustTokenizer:
        """The `tokenizers` tokenizer (its `to_str()` is what grammars compile against)."""
        return self._tok

    # ─────────────────────────── encode / decode ───────────────────────────

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """`encode`, on a worker thread when the text is long (the Rust side drops the GIL)."""
        if len(text) < THREAD_ENCODE_CHARS:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return await anyio.to_thread.run_sync(
            lambda: self.encode(text, add_special_tokens=add_special_tokens)
        )

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a token may hold part of a UTF-8 character)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_token_ids:
            return piece.encode()
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # sentencepiece byte fallback
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs (a partial character shows as U+FFFD, like OpenAI)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # ─────────────────────────── chat ───────────────────────────

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` to the prompt text (tokenize it with `add_special_tokens=False`).

        Raises:
            ChatTemplateError: no template, or the template rejected the messages.
        """
        source = chat_template or self.chat_template
        if not source:
            raise ChatTemplateError(
                "this model has no chat template; use /v1/completions or pass chat_template"
            )
        try:
            template = self._compile(source) if chat_template else self._default_template()
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2 raises many types; all mean "these messages don't fit"
            raise ChatTemplateError(f"chat template error: {e}") from None

    def _default_template(self) -> Any:
        if self._template is None:
            assert self.chat_template is not None
            self._template = self._compile(self.chat_template)
        return self._template

    @staticmethod
    def _compile(source: str) -> Any:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        def tojson(
            value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys=False
        ) -> str:
            return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            return env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
    """Load the tokenizer of the HF model directory `path`.

    Reads tokenizer.json, tokenizer_config.json (special tokens, inline chat template),
    chat_template.jinja / chat_template.json, and generation_config.json / config.json (the
    extra EOS ids that end generation).
    """
    root = pathlib.Path(path)
    cfg = _read_json(root / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # a list of named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    elif (root / "chat_template.json").is_file():
        template = _read_json(root / "chat_template.json").get("chat_template", template)
    if (root / "tokenizer.json").is_file():
        backend = _RustTokenizer.from_file(str(root / "tokenizer.json"))
    else:
        backend, template = _convert_slow(root, template)
    extra_eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(root / name).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        extra_eos.extend(i for i in ids if isinstance(i, int) and i not in extra_eos)
        if ids:
            break
    max_len = cfg.get("model_max_length")
    return Tokenizer(
        backend,
        bos_token=_token_content(cfg.get("bos_token")),
        eos_token=_token_content(cfg.get("eos_token")),
        chat_template=template if isinstance(template, str) else None,
        extra_eos_token_ids=extra_eos,
        model_max_length=max_len if isinstance(max_len, int) and max_len < 2**40 else None,
    )


def _convert_slow(root: pathlib.Path, template: object) -> tuple[_RustTokenizer, object]:
    """No tokenizer.json: let transformers build the fast tokenizer once (imports torch)."""
    logger.warning(
        "%s has no tokenizer.json; converting the slow tokenizer with transformers", root
    )
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(root))
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"cannot build a fast tokenizer for {root}")
    return backend, template or getattr(hf, "chat_template", None)
