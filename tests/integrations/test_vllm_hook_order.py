"""The order of vLLM's calls that layer-wise packing and direct reads rest on,
read in the installed vLLM's source.

A layer group is packed (``layer_groups``), or hashed and offered for the
decoder to READ (``direct_reads``), once ``save_kv_layer`` ran for its
layers (:mod:`fabric.integrations.vllm.layered`). The checksum is taken
then, so a hook that ran before its layer's KV was written would have the
stale bytes hashed and read alike, and loaded: nothing after the fact can
tell. These tests fail when a vLLM upgrade changes that order:

- ``maybe_transfer_kv_layer`` (``vllm/model_executor/layers/attention/
  kv_transfer_utils.py``) calls the attention op, then ``save_kv_layer``;
- it wraps ``unified_attention_with_output`` (``attention.py``), the op the
  attention layer runs;
- the layer writes its KV (``unified_kv_cache_update``) before that op when
  its backend's forward does not (the CPU backend's does not).
"""

from __future__ import annotations

import inspect

import pytest

attention = pytest.importorskip("vllm.model_executor.layers.attention.attention")
kv_transfer_utils = pytest.importorskip("vllm.model_executor.layers.attention.kv_transfer_utils")


def _order(source: str, *calls: str) -> list[int]:
    at = [source.find(call) for call in calls]
    assert all(i >= 0 for i in at), dict(zip(calls, at, strict=True))
    return at


def test_save_kv_layer_runs_after_the_attention_op() -> None:
    source = inspect.getsource(kv_transfer_utils.maybe_transfer_kv_layer)
    op, save = _order(source, "result = func(*args, **kwargs)", "connector.save_kv_layer(")
    assert op < save


def test_the_attention_op_is_the_one_wrapped() -> None:
    source = inspect.getsource(attention)
    assert "@maybe_transfer_kv_layer\ndef unified_attention_with_output(" in source


def test_the_kv_is_written_before_the_attention_op_in_both_paths() -> None:
    source = inspect.getsource(attention.Attention.forward)
    for update, op in (
        ("kv_cache_dummy_dep = unified_kv_cache_update(", "unified_attention_with_output("),
        (
            "torch.ops.vllm.unified_kv_cache_update(",
            "torch.ops.vllm.unified_attention_with_output(",
        ),
    ):
        first, then = _order(source, update, op)
        assert first < then, (update, op)


def test_the_cpu_backend_leaves_the_kv_update_to_the_layer() -> None:
    cpu = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    backends = [
        obj
        for obj in vars(cpu).values()
        if inspect.isclass(obj)
        and obj.__module__ == cpu.__name__
        and "forward_includes_kv_cache_update" in vars(obj)
    ]
    assert backends, "no backend in cpu_attn sets forward_includes_kv_cache_update"
    assert all(b.forward_includes_kv_cache_update is False for b in backends)
