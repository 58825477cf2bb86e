"""Random LoRA adapters for the tiny Llama: files, PEFT names and shapes, determinism (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fabric.cli import main as cli_main
from fabric.testing.models import TinyModelSpec, make_tiny_lora, make_tiny_model
from fabric.testing.models.lora import ADAPTER_FILES, CONFIG_NAME, WEIGHTS_NAME


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def adapter_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lora(tmp_path_factory.mktemp("lora"), tiny_dir, seed=1)


def read_config(adapter: Path) -> dict[str, Any]:
    return dict(json.loads((adapter / CONFIG_NAME).read_text()))


def read_weights(adapter: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(str(adapter / WEIGHTS_NAME)))


def test_writes_both_files(adapter_dir: Path) -> None:
    for name in ADAPTER_FILES:
        assert (adapter_dir / name).is_file(), name
    assert not list(adapter_dir.glob("*.tmp"))


def test_config_is_a_plain_peft_lora(adapter_dir: Path, tiny_dir: Path) -> None:
    config = read_config(adapter_dir)
    assert config["peft_type"] == "LORA"
    assert config["r"] == 8
    assert config["lora_alpha"] == 8
    assert config["target_modules"] == ["k_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(tiny_dir.resolve())
    assert config["bias"] == "none" and not config["use_dora"] and not config["modules_to_save"]


def test_weights_have_peft_names_and_shapes(adapter_dir: Path) -> None:
    import torch

    spec = TinyModelSpec()
    kv_dim = spec.num_kv_heads * spec.head_dim
    weights = read_weights(adapter_dir)
    assert len(weights) == spec.num_layers * 2 * 2  # layers x {k,v} x {A,B}
    for layer in range(spec.num_layers):
        for proj in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            lora_a, lora_b = weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"]
            assert tuple(lora_a.shape) == (8, spec.hidden_size)
            assert tuple(lora_b.shape) == (kv_dim, 8)
            assert lora_a.dtype == lora_b.dtype == torch.bfloat16
            # NOTE: a trained adapter starts at B = 0; this one must move the KV.
            assert lora_b.float().abs().mean() > 0.1


def test_other_targets_and_rank(tmp_path: Path) -> None:
    spec = TinyModelSpec.for_variant(kv_heavy=True)
    adapter = make_tiny_lora(tmp_path / "a", spec, rank=4, targets=("q_proj", "o_proj"))
    weights = read_weights(adapter)
    q_dim = spec.num_heads * spec.head_dim
    prefix = "base_model.model.model.layers.31.self_attn"
    assert tuple(weights[f"{prefix}.q_proj.lora_B.weight"].shape) == (q_dim, 4)
    assert tuple(weights[f"{prefix}.o_proj.lora_A.weight"].shape) == (4, q_dim)
    assert tuple(weights[f"{prefix}.o_proj.lora_B.weight"].shape) == (spec.hidden_size, 4)
    assert read_config(adapter)["target_modules"] == ["q_proj", "o_proj"]


def test_same_seed_same_files_other_seed_other_weights(
    adapter_dir: Path, tiny_dir: Path, tmp_path: Path
) -> None:
    again = make_tiny_lora(tmp_path / "again", tiny_dir, seed=1)
    other = make_tiny_lora(tmp_path / "other", tiny_dir, seed=2)
    for name in ADAPTER_FILES:
        assert (again / name).read_bytes() == (adapter_dir / name).read_bytes(), name
    assert (other / WEIGHTS_NAME).read_bytes() != (adapter_dir / WEIGHTS_NAME).read_bytes()
    assert (other / CONFIG_NAME).read_bytes() == (adapter_dir / CONFIG_NAME).read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rank": 0}, "rank"), ({"targets": ("gate_proj",)}, "targets"), ({"targets": ()}, "targets")],
)
def test_bad_arguments_are_refused(
    tiny_dir: Path, tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_lora(tmp_path / "bad", tiny_dir, **kwargs)


def test_cli_builds_adapter(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["model", "lora", str(tmp_path / "cli"), "--model", str(tiny_dir), "--seed", "1"]
    assert cli_main(argv) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == (tmp_path / "cli").resolve()
    assert read_config(printed)["r"] == 8


def test_cli_lora_needs_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["model", "lora", str(tmp_path / "cli")])
    assert exc.value.code == 2
    assert "--model" in capsys.readouterr().err
