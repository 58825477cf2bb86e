"""The tiny random-weight Llama: files, geometry, tokenizer, determinism (no vLLM)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fabric.cli import main as cli_main
from fabric.testing.models import TinyModelSpec, make_tiny_model
from fabric.testing.models.tiny import MARKER_NAME, MODEL_FILES, WEIGHTS_NAME
from fabric.testing.models.tokenizer import BOS_TOKEN, EOS_TOKEN, EOT_TOKEN


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def heavy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("heavy"), kv_heavy=True)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


def read_json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {name: (model_dir / name).read_bytes() for name in (*MODEL_FILES, MARKER_NAME)}


def test_writes_every_file(tiny_dir: Path) -> None:
    for name in (*MODEL_FILES, MARKER_NAME):
        assert (tiny_dir / name).is_file(), name
    assert not list(tiny_dir.glob("*.tmp"))


def test_default_config(tiny_dir: Path) -> None:
    config = read_json(tiny_dir / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    assert {key: config[key] for key in expected} == expected
    assert TinyModelSpec().kv_bytes_per_token == 2 * 1024


def test_kv_heavy_geometry_is_128_kib_per_token(heavy_dir: Path) -> None:
    config = read_json(heavy_dir / "config.json")
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim, hidden = config["head_dim"], config["hidden_size"]
    assert (layers, kv_heads, head_dim, hidden) == (32, 8, 128, 256)
    bf16_bytes = 2
    assert 2 * layers * kv_heads * head_dim * bf16_bytes == 128 * 1024
    assert TinyModelSpec.for_variant(kv_heavy=True).kv_bytes_per_token == 128 * 1024


def test_weights_match_config(heavy_dir: Path) -> None:
    import torch
    from safetensors import safe_open

    config = read_json(heavy_dir / "config.json")
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    with safe_open(str(heavy_dir / WEIGHTS_NAME), framework="pt") as weights:
        names = set(weights.keys())
        k_proj = weights.get_tensor("model.layers.31.self_attn.k_proj.weight")
        q_proj = weights.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert len(names) == 9 * config["num_hidden_layers"] + 3
    assert k_proj.dtype == torch.bfloat16
    assert tuple(k_proj.shape) == (kv_dim, config["hidden_size"])
    assert tuple(q_proj.shape) == (q_dim, config["hidden_size"])


def test_loads_in_transformers_with_every_weight(tiny_dir: Path) -> None:
    import torch

    transformers = pytest.importorskip("transformers")
    loaded: Any = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.bfloat16, output_loading_info=True
    )
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"]
    logits = model(torch.tensor([[0, 5, 6, 7]])).logits
    assert tuple(logits.shape) == (1, 4, 512)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "text",
    ["The prefill engine reads the whole prompt.", "héllo wörld, 日本語 🙂", "  two\n\tlines  "],
)
def test_tokenizer_round_trip(hf_tokenizer: Any, text: str) -> None:
    ids = hf_tokenizer(text).input_ids
    assert ids[0] == hf_tokenizer.bos_token_id
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(0 <= token_id < 512 for token_id in ids)


def test_tokenizer_special_tokens(hf_tokenizer: Any, tiny_dir: Path) -> None:
    assert hf_tokenizer.bos_token == BOS_TOKEN
    assert hf_tokenizer.eos_token == EOS_TOKEN
    assert len(hf_tokenizer) == 512
    config = read_json(tiny_dir / "config.json")
    assert config["bos_token_id"] == hf_tokenizer.bos_token_id
    assert config["eos_token_id"] == hf_tokenizer.eos_token_id
    generation = read_json(tiny_dir / "generation_config.json")
    assert hf_tokenizer.convert_tokens_to_ids(EOT_TOKEN) in generation["eos_token_id"]


def test_chat_template_renders(hf_tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is a KV cache?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(hf_tokenizer.bos_token_id) == 1
    assert ids.count(hf_tokenizer.convert_tokens_to_ids(EOT_TOKEN)) == 2


def test_same_seed_same_files(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again")
    assert file_bytes(again) == file_bytes(tiny_dir)


def test_other_seed_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert (other / WEIGHTS_NAME).read_bytes() != (tiny_dir / WEIGHTS_NAME).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_rebuild_is_skipped_when_present(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m")
    weights = model_dir / WEIGHTS_NAME
    before = weights.stat().st_mtime_ns
    assert make_tiny_model(model_dir) == model_dir
    assert weights.stat().st_mtime_ns == before


def test_rebuild_when_parameters_or_files_differ(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m")
    seed0 = (model_dir / WEIGHTS_NAME).read_bytes()
    make_tiny_model(model_dir, seed=3)
    assert read_json(model_dir / MARKER_NAME)["seed"] == 3
    assert (model_dir / WEIGHTS_NAME).read_bytes() != seed0
    (model_dir / "tokenizer.json").unlink()
    make_tiny_model(model_dir, seed=3)
    assert (model_dir / "tokenizer.json").is_file()


def test_cli_builds_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["model", "tiny", str(tmp_path / "cli"), "--seed", "2"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == (tmp_path / "cli").resolve()
    assert read_json(printed / MARKER_NAME)["seed"] == 2
