"""The identities chunk keys commit to, read from vLLM's objects.

Model (worker side, once): :func:`model_identity` digests what decides the
weights' KV for given token ids -- the weight files' content, the model
config after overrides, dtype, quantization and KV-cache dtype -- into the
layout fingerprint's ``model`` field. A weights file is named by the
SHA-256 of its content: free to read for a file in a Hugging Face cache
(its LFS blob is named so), hashed in full once for any other and cached
under
``FABRIC_CACHE_DIR`` (default ``$VLLM_CACHE_ROOT/fabric``, else
``~/.cache/fabric``) by inode, size, mtime
and ctime, so a restart costs a stat. A model rebuilt or updated under the
same path gets a new identity, so its engine never hits chunks the old
weights left on disk; two hosts with identical copies agree (paths and
times are only the cache's lookup, never part of the digest).
``model_revision`` in the connector config replaces the weight-file digest
(for weights the engine cannot read as local files).

Request (scheduler side, per request): :func:`request_identity` reads the
fields vLLM 0.32's own prefix cache keys on (``vllm/v1/core/kv_cache_utils.py``,
``generate_block_hash_extra_keys``: LoRA, multimodal features with their
positions, ``cache_salt``, prompt embeddings) into a
:class:`~fabric.kv.identity.KeyIdentity`. A LoRA adapter is named by its
name and a digest of its files (not its path: a name re-pointed at other
weights must miss). A request fabric cannot key -- prompt embeddings, an
adapter whose files cannot be read, a multimodal item without identifier --
gets ``None``: it bypasses fabric entirely.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from fabric.kv.identity import KeyIdentity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
# Config keys that name where a model was loaded from, not what it computes.
_CONFIG_NOISE = frozenset(("_name_or_path", "transformers_version", "_commit_hash"))
_LFS_BLOB = re.compile(r"[0-9a-f]{64}")  # an LFS blob is named by its content's SHA-256
_READ_BYTES = 8 << 20
_cache_lock = threading.Lock()


def file_digest(path: Path) -> str:
    """``sha256:`` + the SHA-256 of a file's content: the name of its LFS
    blob when it links into a hub cache, else hashed once and cached (see
    the module doc). The same bytes give the same digest either way."""
    if path.is_symlink():
        blob = Path(os.readlink(path)).name
        if _LFS_BLOB.fullmatch(blob) and path.resolve().parent.name == "blobs":
            return f"sha256:{blob}"
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    cache_path = _cache_path()
    cache = _digest_cache(cache_path)
    if stamp in cache:
        return cache[stamp]
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_BYTES):
            hasher.update(chunk)
    digest = cache[stamp] = f"sha256:{hasher.hexdigest()}"
    _save_digest_cache(cache_path, cache)
    return digest


def _cache_path() -> Path:
    root = os.environ.get("FABRIC_CACHE_DIR")
    if not root and os.environ.get("VLLM_CACHE_ROOT"):
        root = os.path.join(os.environ["VLLM_CACHE_ROOT"], "fabric")
    return Path(root or os.path.join(os.path.expanduser("~"), ".cache", "fabric")) / (
        "file-digests.json"
    )


@functools.lru_cache(maxsize=8)
def _digest_cache(path: Path) -> dict[str, str]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}


def _save_digest_cache(path: Path, cache: dict[str, str]) -> None:
    """Best effort: a cache that cannot be written only costs a rehash."""
    with _cache_lock:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, path)
        except OSError as exc:
            logger.info("fabric: cannot write the file digest cache %s: %s", path, exc)


def dir_digest(directory: Path, names: list[str]) -> str:
    """Digest of the named files of ``directory`` (name and :func:`file_digest`)."""
    hasher = blake3.blake3(b"fabric-files/1")
    for name in sorted(names):
        hasher.update(name.encode("utf-8") + b"\0" + file_digest(directory / name).encode())
    return hasher.hexdigest()


def weights_digest(model_dir: Path) -> str | None:
    """Digest of a local model's weight files (a directory, or one weights
    file such as a GGUF); None if there are none."""
    if model_dir.is_file():
        return dir_digest(model_dir.parent, [model_dir.name])
    names = [p.name for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    return dir_digest(model_dir, names) if names else None


def _local_model_dir(model: str, revision: str | None) -> Path | None:
    """Where the weights of ``model`` are on this host (a directory or file,
    or the Hugging Face cache snapshot of a hub id), or None."""
    if os.path.isdir(model) or os.path.isfile(model):
        return Path(model)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:  # NOTE: any failure means "not known locally"
        return None
    return Path(found).parent if isinstance(found, str) else None


def model_identity(vllm_config: VllmConfig, override: str | None = None) -> str:
    """``w:`` + 32 hex digits naming the KV the engine's weights compute."""
    model = vllm_config.model_config
    doc: dict[str, Any] = {
        "weights": override or _weights_id(model.model, getattr(model, "revision", None)),
        "config": _config_doc(model),
        "dtype": str(model.dtype),
        "quantization": getattr(model, "quantization", None),
        "kv_cache_dtype": str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    ident = "w:" + blake3.blake3(text.encode("utf-8")).hexdigest()[:32]
    logger.info("fabric: model identity %s (weights %s)", ident, doc["weights"])
    return ident


def _weights_id(model: str, revision: str | None) -> str:
    directory = _local_model_dir(model, revision)
    digest = weights_digest(directory) if directory is not None else None
    if digest is not None:
        return digest
    # NOTE: weights not readable here: the hub id and revision stand for them.
    logger.warning(
        "fabric: the weights of %s cannot be read as local files; chunk keys name them by "
        "id and revision (%s) only. Set kv_connector_extra_config.model_revision when the "
        "weights under that name can change (a disk tier or shared store outlives them)",
        model,
        revision or "unpinned",
    )
    return f"{model}@{revision or 'unpinned'}"


def _config_doc(model: Any) -> Any:
    config = getattr(model, "hf_config", None)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        return None
    return _without_noise(to_dict())


def _without_noise(doc: Any) -> Any:
    """``doc`` without the keys that name a config's origin, at any depth."""
    if isinstance(doc, dict):
        return {k: _without_noise(v) for k, v in doc.items() if k not in _CONFIG_NOISE}
    if isinstance(doc, list | tuple):
        return [_without_noise(v) for v in doc]
    return doc


@functools.lru_cache(maxsize=256)
def _adapter_digest(path: str, stamp: tuple[tuple[str, int, int, int], ...]) -> str:
    """Digest of an adapter directory's files (``stamp`` keys the cache)."""
    return dir_digest(Path(path), [entry[0] for entry in stamp])


def lora_identity(lora_request: Any) -> str | None:
    """``name:digest`` of a vLLM ``LoRARequest``; None when its files cannot be read."""
    name, path = getattr(lora_request, "lora_name", None), getattr(lora_request, "lora_path", None)
    if not name or not path or not os.path.isdir(path):
        return None
    try:
        stamp = tuple(
            (n, (st := os.stat(os.path.join(path, n))).st_ino, st.st_size, st.st_ctime_ns)
            for n in ADAPTER_FILES
            if os.path.isfile(os.path.join(path, n))
        )
        if not any(entry[0] != "adapter_config.json" for entry in stamp):
            return None
        return f"{name}:{_adapter_digest(path, stamp)}"
    except OSError:
        return None


def request_identity(request: Any) -> KeyIdentity | None:
    """The request's :class:`KeyIdentity`, or None when fabric cannot key it."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = ""
    lora_request = getattr(request, "lora_request", None)
    if lora_request is not None:
        found = lora_identity(lora_request)
        if found is None:
            return None
        lora = found
    mm = []
    for feature in getattr(request, "mm_features", None) or ():
        ident, pos = getattr(feature, "identifier", None), getattr(feature, "mm_position", None)
        if not ident or pos is None:
            return None
        mm.append((str(ident), int(pos.offset), int(pos.length)))
    salt = getattr(request, "cache_salt", None) or ""
    return KeyIdentity(lora, str(salt), tuple(sorted(mm, key=lambda item: item[1])))
