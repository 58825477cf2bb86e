"""Key identity read from vLLM's objects, and what the connector does with it.

Requests are vLLM-shaped fakes (the attribute names are vLLM 0.32's
``vllm/v1/request.py``: ``lora_request``, ``cache_salt``, ``mm_features``,
``prompt_embeds``); the worker is a real FabricWorker with its reuse tier
asked over its real control endpoint.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fabric.integrations.vllm.config import ConnectorConfig
from fabric.integrations.vllm.identity import (
    lora_identity,
    model_identity,
    request_identity,
    weights_digest,
)
from fabric.integrations.vllm.metadata import FabricMetadata, PackChunk, SendPlan
from fabric.integrations.vllm.scheduler import FabricScheduler
from fabric.integrations.vllm.tier_client import WorkerTierClient
from fabric.kv.identity import BASE, KeyIdentity
from fabric.testing.models import make_tiny_model
from tests.integrations.test_vllm_reuse_scheduler import FakeTier
from tests.integrations.test_vllm_reuse_worker import CB, TOKENS, make
from tests.integrations.test_vllm_scheduler import BS, CT, NewReq, Out


@dataclass
class VReq:
    """A vLLM ``Request`` as far as the connector reads it."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None


def adapter(tmp: Path, name: str, content: bytes) -> SimpleNamespace:
    path = tmp / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(content)
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))


def test_request_identity_covers_salt_adapter_and_images(tmp_path: Path) -> None:
    assert request_identity(VReq("a", [1])) == BASE
    assert request_identity(VReq("a", [1], cache_salt="t")) == KeyIdentity(cache_salt="t")
    lora = request_identity(VReq("a", [1], lora_request=adapter(tmp_path, "la", b"w1")))
    assert lora is not None and lora.lora.startswith("la:")
    image = SimpleNamespace(identifier="h", mm_position=SimpleNamespace(offset=5, length=3))
    assert request_identity(VReq("a", [1], mm_features=[image])) == KeyIdentity(mm=(("h", 5, 3),))


def test_an_adapter_is_named_by_its_files_not_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FABRIC_CACHE_DIR", str(tmp_path / "cache"))
    first = lora_identity(adapter(tmp_path / "a", "la", b"weights-1"))
    moved = lora_identity(adapter(tmp_path / "b", "la", b"weights-1"))
    retrained = lora_identity(adapter(tmp_path / "c", "la", b"weights-2"))
    assert first == moved and first != retrained


@pytest.mark.parametrize(
    "req",
    [
        VReq("a", [1], prompt_embeds=object()),
        VReq("a", [1], lora_request=SimpleNamespace(lora_name="x", lora_path="/nonexistent")),
        VReq("a", [1], mm_features=[SimpleNamespace(identifier=None, mm_position=None)]),
    ],
)
def test_inputs_fabric_cannot_key_bypass_it(req: VReq) -> None:
    assert request_identity(req) is None
    tier = FakeTier(chunks=3)
    s = FabricScheduler(ConnectorConfig(chunk_tokens=CT), BS, produce=True, consume=True, tier=tier)
    req.prompt_token_ids = list(range(300))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, list(range(19)), 0)
    meta = s.build_connector_meta(Out(scheduled_new_reqs=[NewReq("a", (list(range(19)),), 0)]))
    assert tier.calls == [] and meta.sends == [] and meta.packs == []
    assert s.counters.take()["bypassed_requests"] == 1
    pd = dict(do_remote_prefill=True, transfer_id="t", num_tokens=300, chunk_tokens=CT)
    req.kv_transfer_params = pd
    req.request_id = "b"
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)  # no PD load either


def test_a_decoder_refuses_a_prefiller_with_another_chunk_size() -> None:
    s = FabricScheduler(ConnectorConfig(chunk_tokens=CT), BS, produce=False, consume=True)
    params = dict(do_remote_prefill=True, transfer_id="t", num_tokens=300, chunk_tokens=2 * CT)
    assert s.get_num_new_matched_tokens(VReq("r", list(range(300)), params), 0) == (0, False)
    assert s.counters.take()["refused_transfers"] == 1
    params["chunk_tokens"] = CT  # the next request is served normally
    assert s.get_num_new_matched_tokens(VReq("r2", list(range(300)), params), 0) == (300, True)


def test_the_scheduler_sends_the_identity_with_lookups_and_saves() -> None:
    class Recording(FakeTier):
        def lookup(self, request_id: str, token_ids: list[int], identity: KeyIdentity) -> int:
            self.identities.append(identity)
            return super().lookup(request_id, token_ids, identity)

    tier = Recording(chunks=0)
    tier.identities = []  # type: ignore[attr-defined]
    s = FabricScheduler(ConnectorConfig(chunk_tokens=CT), BS, produce=True, consume=True, tier=tier)
    req = VReq("a", list(range(300)), cache_salt="tenant-A")
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, list(range(19)), 0)
    meta = s.build_connector_meta(Out(scheduled_new_reqs=[NewReq("a", (list(range(19)),), 0)]))
    assert tier.identities == [KeyIdentity(cache_salt="tenant-A")]  # type: ignore[attr-defined]
    assert meta.sends[0].identity == KeyIdentity(cache_salt="tenant-A")


def test_same_tokens_with_another_salt_or_adapter_miss_the_store(tmp_path: Path) -> None:
    w = make(seed=99)
    try:
        salted = KeyIdentity(cache_salt="tenant-A")
        packs = [PackChunk("r1", i, list(range(i * CB, (i + 1) * CB))) for i in range(4)]
        plan = SendPlan("r1", None, None, TOKENS[: 4 * CT], [CB] * 4, salted)
        w.pack_step(FabricMetadata(sends=[plan], packs=packs))
        w.before_step()
        config = ConnectorConfig(chunk_tokens=CT, lookup_timeout_ms=2000)
        client = WorkerTierClient(config, tp_size=1, engine_id=w.engine_id)
        try:
            assert client.lookup("q1", TOKENS[: 4 * CT], salted) == 4
            assert client.lookup("q2", TOKENS[: 4 * CT], KeyIdentity(cache_salt="B")) == 0
            assert client.lookup("q3", TOKENS[: 4 * CT]) == 0
            assert client.lookup("q4", TOKENS[: 4 * CT], KeyIdentity(lora="l:1")) == 0
        finally:
            client.close()
    finally:
        w.shutdown()


def model_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=str(model_dir), dtype="bfloat16", revision=None, hf_config=hf, quantization=None
        ),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


def test_model_identity_follows_the_weights_not_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FABRIC_CACHE_DIR", str(tmp_path / "cache"))
    first = make_tiny_model(tmp_path / "m")
    ident = model_identity(model_config(first))
    copy = Path(shutil.copytree(first, tmp_path / "elsewhere"))
    assert model_identity(model_config(copy)) == ident  # another host's copy agrees
    make_tiny_model(first, seed=1)  # rebuilt in place with other weights
    assert weights_digest(first) != weights_digest(copy)
    assert model_identity(model_config(first)) != ident
    assert model_identity(model_config(first), "pinned-rev") == model_identity(
        model_config(copy), "pinned-rev"
    )


def test_a_small_edit_anywhere_in_the_weights_changes_the_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FABRIC_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(bytes(8 << 20))
    before = weights_digest(model)
    with weights.open("r+b") as f:  # e.g. a recalibrated k_scale deep in the file
        f.seek(5_123_457)
        f.write(b"\x01\x02\x03\x04")
    assert weights_digest(model) != before
    assert (tmp_path / "cache" / "file-digests.json").exists()


def test_a_hub_cache_file_and_a_plain_copy_of_it_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    monkeypatch.setenv("FABRIC_CACHE_DIR", str(tmp_path / "cache"))
    content = b"the weights"
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    sha = hashlib.sha256(content).hexdigest()
    (blobs / sha).write_bytes(content)
    (snap / "model.safetensors").symlink_to(blobs / sha)
    plain = tmp_path / "copy"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(content)
    assert weights_digest(snap) == weights_digest(plain)
    (plain / "model.safetensors").write_bytes(b"other weights")
    assert weights_digest(snap) != weights_digest(plain)
