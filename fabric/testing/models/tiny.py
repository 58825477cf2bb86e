"""Tiny random-weight Llama models that vLLM loads like real checkpoints.

``make_tiny_model(dir)`` writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (bf16) and an offline-trained tokenizer. Weights are
random but fixed by the seed, so every process that loads the directory
computes the same greedy tokens: the oracle the PD tests compare against.

Two geometries:

==========  ======  ======  ========  =====  ========  ========  ============
variant     layers  hidden  heads     kv     head_dim  params    KV per token
==========  ======  ======  ========  =====  ========  ========  ============
default     4       256     4         2      64        ~2.6 M    2 KiB
kv_heavy    32      256     8         8      128       ~46 M     128 KiB
==========  ======  ======  ========  =====  ========  ========  ============

``kv_heavy`` has Llama-3-8B's KV geometry (32 layers x 8 KV heads x 128) with
a tiny hidden size, so transfers are as large as a real model's while the
forward pass stays cheap on a CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.testing.models.tokenizer import BOS_TOKEN, EOS_TOKEN, EOT_TOKEN, write_tokenizer

if TYPE_CHECKING:
    import torch

# NOTE: bump when the files written change, so stale directories are rebuilt.
FORMAT_VERSION = 2
MARKER_NAME = "fabric-tiny.json"
WEIGHTS_NAME = "model.safetensors"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS_NAME,
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Geometry and seed of a tiny Llama; two equal specs give identical files."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def for_variant(cls, *, kv_heavy: bool = False, seed: int = 0) -> TinyModelSpec:
        """The default tiny model, or the Llama-3-8B-KV-geometry one."""
        if kv_heavy:
            return cls(num_layers=32, num_heads=8, num_kv_heads=8, head_dim=128, seed=seed)
        return cls(seed=seed)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of bf16 K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def make_tiny_model(
    out_dir: str | os.PathLike[str], *, kv_heavy: bool = False, seed: int = 0
) -> Path:
    """Write a tiny random-weight Llama into ``out_dir`` and return its path.

    Idempotent: if ``out_dir`` already holds the model for these parameters
    (its marker file matches and every file exists) nothing is rewritten.
    """
    spec = TinyModelSpec.for_variant(kv_heavy=kv_heavy, seed=seed)
    return write_model(Path(out_dir), spec)


def write_model(out_dir: Path, spec: TinyModelSpec) -> Path:
    """Write the model described by ``spec`` into ``out_dir`` unless it is there."""
    out_dir = out_dir.resolve()
    marker = _marker(spec)
    if _holds_model(out_dir, marker):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER_NAME).unlink(missing_ok=True)
    token_ids = write_tokenizer(out_dir, spec.vocab_size, spec.max_position_embeddings)
    _write_json(out_dir / "config.json", model_config(spec, token_ids))
    _write_json(out_dir / "generation_config.json", generation_config(token_ids))
    _write_weights(out_dir / WEIGHTS_NAME, spec)
    # NOTE: the marker goes last: a directory without it is rebuilt.
    _write_json(out_dir / MARKER_NAME, marker)
    return out_dir


def model_config(spec: TinyModelSpec, token_ids: dict[str, int]) -> dict[str, Any]:
    """The HF ``config.json`` of a ``LlamaForCausalLM`` with ``spec``'s geometry."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        # NOTE: both spellings: transformers 5 reads rope_parameters, 4.x rope_theta.
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": token_ids[EOS_TOKEN],
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def generation_config(token_ids: dict[str, int]) -> dict[str, Any]:
    """``generation_config.json``: stop on end-of-text or end-of-turn."""
    return {
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": [token_ids[EOS_TOKEN], token_ids[EOT_TOKEN]],
    }


def weight_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by HF Llama name, in generation order."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, hidden)}
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_dim)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (spec.vocab_size, hidden)
    return shapes


def random_weights(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """bf16 weights drawn from one generator seeded with ``spec.seed``.

    Norm weights are ones; matrices are N(0, std^2), std from ``init_std``.
    """
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(spec).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        std = init_std(spec, name, shape)
        tensor = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        weights[name] = tensor.to(torch.bfloat16).contiguous()
    return weights


def init_std(spec: TinyModelSpec, name: str, shape: tuple[int, ...]) -> float:
    """Standard deviation of the weight ``name``: 1/sqrt(fan_in), adjusted per role.

    NOTE: chosen by measurement (random prompts, greedy, transformers bf16):
    plain 1/sqrt(fan_in) lets the 32-layer model fall into 2-token loops
    whatever the prompt. Residual-branch outputs (o_proj, down_proj) scaled
    by 1/sqrt(2 * layers) keep the residual stream at unit scale; q/k at 2x
    make attention peaked, so swapping two 128-token KV blocks of a 715-token
    prompt changes the next token in about half the prompts (never at 1x);
    lm_head at 4x gives logprobs around -1. The price: computing the last
    tokens against cached KV instead of in one prefill moves the kv_heavy
    model's logprobs by up to ~0.1 (the 4-layer one: 0.0).
    """
    base = 1.0 / math.sqrt(shape[-1])
    if name == "model.embed_tokens.weight":
        return 1.0
    if name == "lm_head.weight":
        return 4.0 * base
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return 2.0 * base
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return base / math.sqrt(2 * spec.num_layers)
    return base


def _write_weights(path: Path, spec: TinyModelSpec) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(random_weights(spec), str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # NOTE: safetensors creates the file 0600
    os.replace(tmp, path)


def _marker(spec: TinyModelSpec) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, **dataclasses.asdict(spec)}


def _holds_model(out_dir: Path, marker: dict[str, Any]) -> bool:
    try:
        found = json.loads((out_dir / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return found == marker and all((out_dir / name).is_file() for name in MODEL_FILES)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
