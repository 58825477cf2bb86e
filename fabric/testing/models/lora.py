"""Random PEFT LoRA adapters for the tiny Llama, as vLLM loads them with
``--enable-lora --lora-modules NAME=DIR``.

``make_tiny_lora(dir, model)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` for the layers of ``model`` (a tiny model
directory or a :class:`~fabric.testing.models.tiny.TinyModelSpec`). Each target
``T`` of layer ``N`` gets::

    base_model.model.model.layers.N.self_attn.T.lora_A.weight   [rank, in(T)]
    base_model.model.model.layers.N.self_attn.T.lora_B.weight   [out(T), rank]

    T        in(T)               out(T)
    q_proj   hidden              heads * head_dim
    k_proj   hidden              kv_heads * head_dim
    v_proj   hidden              kv_heads * head_dim
    o_proj   heads * head_dim    hidden

The adapter adds ``(alpha / rank) * B @ A`` to each target. A trained
adapter starts with ``B = 0``; here B is random, so that an adapter on
``k_proj``/``v_proj`` changes the KV of every prompt token: the same token
ids under the base model and under two adapters give three different KV
caches, which is what a cache-identity test needs. Weights are drawn from
one generator seeded with ``seed``: equal arguments give identical files.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fabric.testing.models.tiny import TinyModelSpec

if TYPE_CHECKING:
    import torch

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# NOTE: the update B @ A x has about the spread of the base projection's
# output (A: 1/sqrt(hidden), B: this / sqrt(rank), scaling 1), so the
# adapter's KV is far from the base model's and greedy tokens differ.
DELTA_SCALE = 1.0


def make_tiny_lora(
    out_dir: str | os.PathLike[str],
    model_dir_or_spec: str | os.PathLike[str] | TinyModelSpec,
    *,
    rank: int = 8,
    seed: int = 0,
    targets: Sequence[str] = ("k_proj", "v_proj"),
) -> Path:
    """Write a random rank-``rank`` LoRA adapter for the tiny model into
    ``out_dir`` (created, files overwritten) and return its path."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty subset of {TARGETS}, got {list(targets)}")
    spec, base_name = _base_model(model_dir_or_spec)
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(out / WEIGHTS_NAME, lora_weights(spec, rank=rank, seed=seed, targets=targets))
    _write_json(out / CONFIG_NAME, adapter_config(base_name, rank=rank, targets=targets))
    return out


def adapter_config(base_name: str, *, rank: int, targets: Sequence[str]) -> dict[str, object]:
    """PEFT's ``adapter_config.json`` for a plain LoRA with scaling 1."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
    }


def lora_shapes(
    spec: TinyModelSpec, *, rank: int, targets: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """Every tensor of the adapter, by PEFT name, in generation order."""
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    dims = {
        "q_proj": (spec.hidden_size, q_dim),
        "k_proj": (spec.hidden_size, kv_dim),
        "v_proj": (spec.hidden_size, kv_dim),
        "o_proj": (q_dim, spec.hidden_size),
    }
    shapes: dict[str, tuple[int, int]] = {}
    for layer in range(spec.num_layers):
        for target in targets:
            fan_in, fan_out = dims[target]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            shapes[f"{prefix}.lora_A.weight"] = (rank, fan_in)
            shapes[f"{prefix}.lora_B.weight"] = (fan_out, rank)
    return shapes


def lora_weights(
    spec: TinyModelSpec, *, rank: int, seed: int, targets: Sequence[str]
) -> dict[str, torch.Tensor]:
    """bf16 A and B matrices from one generator seeded with ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in lora_shapes(spec, rank=rank, targets=targets).items():
        std = DELTA_SCALE / math.sqrt(shape[1])  # A: 1/sqrt(fan_in); B: scale/sqrt(rank)
        tensor = torch.randn(shape, generator=gen, dtype=torch.float32) * std
        weights[name] = tensor.to(torch.bfloat16).contiguous()
    return weights


def _base_model(
    model_dir_or_spec: str | os.PathLike[str] | TinyModelSpec,
) -> tuple[TinyModelSpec, str]:
    """The geometry to fit and the name PEFT records as the base model."""
    if isinstance(model_dir_or_spec, TinyModelSpec):
        return model_dir_or_spec, "fabric-tiny"
    model_dir = Path(model_dir_or_spec).resolve()
    config = json.loads((model_dir / "config.json").read_text())
    spec = TinyModelSpec(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
    )
    return spec, str(model_dir)


def _write_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # NOTE: safetensors creates the file 0600
    os.replace(tmp, path)


def _write_json(path: Path, content: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
