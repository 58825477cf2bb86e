"""What the scheduler side tells the worker side each step.

Everything here is plain data (pickled by vLLM between its processes).
Block ids are vLLM's, for KV cache group 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fabric.kv.identity import BASE, KeyIdentity

try:  # vLLM present: subclass its marker base so isinstance checks pass
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:  # unit tests of the pure logic run without vLLM

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class SendPlan:
    """A request whose chunks get packed as they are computed (sent once, first step).

    Prefiller: they go to the decoder at ``endpoint`` as ``transfer_id``.
    Save only (reuse tier, ``endpoint`` None): they stay in this engine's
    store. ``chunk_blocks[i]`` is the number of vLLM blocks chunk ``i``
    covers (the last chunk may be short); ``token_ids`` are the prompt's,
    for the keys, with the request's ``identity``. ``hold``: direct reads;
    vLLM keeps the request's blocks after it finishes until this worker
    reports it sent (``FabricWorker.take_sent``).
    """

    req_id: str
    transfer_id: str | None
    endpoint: str | None
    token_ids: list[int]
    chunk_blocks: list[int]
    identity: KeyIdentity = BASE
    hold: bool = False


@dataclass
class PackChunk:
    """Prefiller: chunk ``index`` of a request is computed as of this step;
    pack ``block_ids`` into the store and push it."""

    req_id: str
    index: int
    block_ids: list[int]


@dataclass
class LoadPlan:
    """Decoder: receive ``transfer_id`` and unpack it into ``block_ids``.

    ``block_ids`` are the blocks for prompt tokens from ``first_block *
    block_size`` on; chunk ``i`` of the transfer holds blocks ``i *
    chunk_blocks ..`` of the prompt. ``token_ids`` (the first
    ``num_tokens`` of the prompt) and ``identity`` give the keys the
    transfer must carry: the worker refuses one whose keys differ.
    """

    req_id: str
    transfer_id: str
    first_block: int
    block_ids: list[int]
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    identity: KeyIdentity = BASE
    shared: bool = False  # fetched from the shared store (counted apart from PD loads)


@dataclass
class Claim:
    """Decoder: request ``req_id`` arrived (vLLM queued it) and will load
    ``transfer_id``; keep what is pushed for it until its load starts or the
    request ends (see :class:`~fabric.integrations.vllm.loader.Loader`)."""

    req_id: str
    transfer_id: str


@dataclass
class LocalLoad:
    """Reuse tier: unpack the first ``num_chunks`` chunks the worker's store
    holds for ``req_id`` (a Lookup with hold) into ``block_ids``, before this
    step's forward pass (a synchronous load).

    ``block_ids`` are the blocks for prompt tokens from ``first_block *
    block_size`` on (blocks before it are vLLM's own prefix-cache hit).
    """

    req_id: str
    first_block: int
    block_ids: list[int]
    num_chunks: int


@dataclass
class FabricMetadata(KVConnectorMetadata):
    sends: list[SendPlan] = field(default_factory=list)
    packs: list[PackChunk] = field(default_factory=list)
    loads: list[LoadPlan] = field(default_factory=list)
    local_loads: list[LocalLoad] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # holds never loaded
    claims: list[Claim] = field(default_factory=list)
    # NOTE: claimed requests vLLM allocated without a load (refused params, a
    # full local hit): their transfer is released
    unclaims: list[str] = field(default_factory=list)
    # NOTE: the step schedules no token: vLLM runs no forward, only the connector
    # (kv_connector_no_forward), and loops at once (see FabricWorker.get_results)
    idle: bool = False
