"""The identities chunk keys commit to, read from vLLM's objects.

Model (worker side, once): :func:`model_identity` digests what decides the
weights' KV for given token ids -- the weight files' content (sampled, so a
70B model costs a few MiB of reads, not its size), the model config after
overrides, dtype, quantization and KV-cache dtype -- into the layout
fingerprint's ``model`` field. A model rebuilt or updated under the same
path gets a new identity, so its engine never hits chunks the old weights
left on disk; two hosts with identical copies agree (paths and mtimes are
not part of it). ``model_revision`` in the connector config replaces the
weight-file digest (for weights the engine cannot read as local files).

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
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from fabric.kv.identity import KeyIdentity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_EDGE_BYTES = 1 << 20  # read in full at each end of a file (headers live there)
_SAMPLES, _SAMPLE_BYTES = 14, 64 << 10  # evenly spaced reads in between
# Config keys that name where a model was loaded from, not what it computes.
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash")


def file_digest(path: Path) -> str:
    """blake3 over a file's size, its first and last MiB and 14 spread 64 KiB
    reads: any rebuild or update of real weights changes these bytes."""
    size = path.stat().st_size
    hasher = blake3.blake3(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        for offset, length in _sample_ranges(size):
            f.seek(offset)
            hasher.update(f.read(length))
    return hasher.hexdigest()


def _sample_ranges(size: int) -> list[tuple[int, int]]:
    if size <= 2 * _EDGE_BYTES + _SAMPLES * _SAMPLE_BYTES:
        return [(0, size)]
    inner = size - 2 * _EDGE_BYTES - _SAMPLE_BYTES
    spread = [_EDGE_BYTES + inner * (i + 1) // (_SAMPLES + 1) for i in range(_SAMPLES)]
    return [
        (0, _EDGE_BYTES),
        *((o, _SAMPLE_BYTES) for o in spread),
        (size - _EDGE_BYTES, _EDGE_BYTES),
    ]


def dir_digest(directory: Path, names: list[str]) -> str:
    """Digest of the named files of ``directory`` (name and :func:`file_digest`)."""
    hasher = blake3.blake3(b"fabric-files/1")
    for name in sorted(names):
        hasher.update(name.encode("utf-8") + b"\0" + file_digest(directory / name).encode())
    return hasher.hexdigest()


def weights_digest(model_dir: Path) -> str | None:
    """Digest of a local model directory's weight files; None if it has none."""
    names = [p.name for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
    return dir_digest(model_dir, names) if names else None


def _local_model_dir(model: str, revision: str | None) -> Path | None:
    """Where the weights of ``model`` are on this host (a directory, or the
    Hugging Face cache snapshot of a hub id), or None."""
    if os.path.isdir(model):
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
    return f"{model}@{revision or 'unpinned'}"


def _config_doc(model: Any) -> Any:
    config = getattr(model, "hf_config", None)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        return None
    doc = to_dict()
    for key in _CONFIG_NOISE:
        doc.pop(key, None)
    return doc


@functools.lru_cache(maxsize=256)
def _adapter_digest(path: str, stamp: tuple[tuple[str, int, int], ...]) -> str:
    """Digest of an adapter directory's files (``stamp`` keys the cache)."""
    return dir_digest(Path(path), [name for name, _, _ in stamp])


def lora_identity(lora_request: Any) -> str | None:
    """``name:digest`` of a vLLM ``LoRARequest``; None when its files cannot be read."""
    name, path = getattr(lora_request, "lora_name", None), getattr(lora_request, "lora_path", None)
    if not name or not path or not os.path.isdir(path):
        return None
    try:
        stamp = tuple(
            (n, (st := os.stat(os.path.join(path, n))).st_size, st.st_mtime_ns)
            for n in ADAPTER_FILES
            if os.path.isfile(os.path.join(path, n))
        )
        if not any(n != "adapter_config.json" for n, _, _ in stamp):
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
