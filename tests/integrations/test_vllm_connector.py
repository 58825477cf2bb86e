"""FabricConnector start-up checks against vLLM's own KV cache specs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from fabric.errors import ConfigError
from fabric.integrations.vllm.connector import check_kv_cache_groups

CONFIG: Any = SimpleNamespace(
    model_config=SimpleNamespace(model="/models/hybrid-7b"),
    parallel_config=SimpleNamespace(pipeline_parallel_size=1),
)


def groups(*specs: Any) -> Any:
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=["l"]) for s in specs]
    )


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def test_one_full_attention_group_is_accepted() -> None:
    check_kv_cache_groups(CONFIG, groups(full()))


def test_a_hybrid_model_is_refused_naming_it() -> None:
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    with pytest.raises(ConfigError, match="hybrid-7b has 2 KV cache groups"):
        check_kv_cache_groups(CONFIG, groups(full(), window))
    with pytest.raises(ConfigError, match="SlidingWindowSpec"):
        check_kv_cache_groups(CONFIG, groups(window))


def test_a_state_space_model_is_refused() -> None:
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,))
    with pytest.raises(ConfigError, match="MambaSpec"):
        check_kv_cache_groups(CONFIG, groups(mamba))


def test_non_causal_attention_is_refused() -> None:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, non_causal=True
    )
    with pytest.raises(ConfigError, match="non-causally"):
        check_kv_cache_groups(CONFIG, groups(spec))


def test_pipeline_parallel_is_refused() -> None:
    config: Any = SimpleNamespace(
        model_config=CONFIG.model_config, parallel_config=SimpleNamespace(pipeline_parallel_size=2)
    )
    with pytest.raises(ConfigError, match="pipeline parallel size 2"):
        check_kv_cache_groups(config, groups(full()))
