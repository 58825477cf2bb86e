"""Typed configuration of a PD topology: engines, proxy and connector.

A topology YAML names the prefill and decode engines, the proxy and the
connector settings every engine shares::

    model: tiny                 # default model of every engine below
    workdir: work               # logs, run state, built models
    prefill:
      - {name: prefill-0, cpu_cores: "0"}
    decode:
      - {name: decode-0, cpu_cores: "1", port: 8200, kv_port: 8201}
    proxy: {port: 8000}
    connector: {chunk_tokens: 256, store_mib: 512}
    store: {mem_gib: 2}         # optional: a shared store every engine attaches to

Across hosts, ``hosts:`` names the machines and each engine (and the proxy)
says where it runs; ``fabric up --host NAME`` on each machine starts what
belongs there (see :class:`HostConfig`)::

    hosts:
      gpu-a: {address: 10.0.0.2}
      gpu-b: {address: 10.0.0.3, bind: 0.0.0.0, ucx_tls: "rc,tcp"}
    prefill:
      - {name: prefill-0, host: gpu-a, port: 8100, kv_port: 8101}
    decode:
      - {name: decode-0, host: gpu-b, port: 8200, kv_port: 8201}
    proxy: {host: gpu-a, port: 8000}
    connector: {secret_env: FABRIC_SECRET}

An engine either runs already (``url``, and for a decoder the ``kv_port`` of
its connector) or is started by ``fabric up`` (``model``, or a ``command``
template for engines that are not vLLM). Unset ports are chosen free at
launch. ``load_topology(path)`` turns every problem into a
:class:`~fabric.errors.ConfigError` whose message names the file and the
field, e.g. ``configs/x.yaml: decode[0].port: Input should be a valid integer``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from fabric.errors import ConfigError
from fabric.settings import Settings, field_path, validating_whole

Role = Literal["prefill", "decode", "both"]
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]
PositiveInt = Annotated[int, Field(strict=True, gt=0)]
Seconds = Annotated[float, Field(gt=0)]
PolicyName = Literal["round_robin", "least_outstanding", "cache_aware"]

LOCAL_HOST = "127.0.0.1"


class HostConfig(Settings):
    """A machine of a topology that spans hosts (an entry of ``hosts:``).

    ``address``: where the other hosts reach it (an IPv4 address or a DNS
    name): its engines' URLs and kv endpoints, the proxy's URL, and what its
    engines advertise to their peers (``VLLM_HOST_IP``, the connector's
    ``advertise_host``). ``bind``: what its servers listen on (default:
    ``address``; ``0.0.0.0`` listens on every interface while peers are
    still told ``address``). ``ucx_net_devices`` / ``ucx_tls``: its
    engines' ``UCX_NET_DEVICES`` and ``UCX_TLS`` (default: unset, UCX's own
    choice among every device and transport; ``lo`` only for a loopback
    address). ``env``: added to the environment of every engine it runs.
    """

    address: str = Field(min_length=1)
    bind: str | None = Field(default=None, min_length=1)
    ucx_net_devices: str | None = Field(default=None, min_length=1)
    ucx_tls: str | None = Field(default=None, min_length=1)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("address", "bind")
    @classmethod
    def _ipv4_or_name(cls, value: str | None) -> str | None:
        return None if value is None else _host_value(value)

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, value: Any) -> Any:
        return _env_strings(value)

    @property
    def bind_host(self) -> str:
        """What its servers bind."""
        return self.bind or self.address

    @property
    def loopback(self) -> bool:
        """Whether only this machine's processes can reach it."""
        from fabric.transfer.addresses import is_loopback

        return is_loopback(self.address) and is_loopback(self.bind_host)


class EngineConfig(Settings):
    """One engine of the topology.

    ``url``: an engine that already runs (``fabric up`` only waits for it).
    Otherwise ``fabric up`` starts it: vLLM serving ``model``, or ``command``
    when given, a template whose ``{port}``, ``{kv_port}``, ``{name}``,
    ``{role}``, ``{model}``, ``{workdir}``, ``{python}`` and
    ``{kv_transfer_config}`` (JSON), ``{host}`` (what it binds) and
    ``{address}`` (what it advertises) are filled in. ``port``/``kv_port`` left
    unset are chosen free at launch. ``env`` is added to the engine's
    environment; ``args`` to vLLM's command line. ``host``: in a topology
    with ``hosts:``, the machine it runs on (a name there, or its address);
    ``host_address`` is derived from it (not a setting).
    """

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    role: Role
    url: str | None = None
    model: str | None = None
    command: list[str] | None = None
    port: Port | None = None
    kv_port: Port | None = None
    env: dict[str, str] = Field(default_factory=dict)
    args: list[str] = Field(default_factory=list)
    cuda_visible_devices: str | None = None
    cpu_cores: str | None = None
    kv_cache_gib: PositiveInt = 1
    host: str | None = Field(default=None, min_length=1)
    host_address: str | None = None

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_strings(cls, value: Any) -> Any:
        return _env_strings(value)

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str | None) -> str | None:
        return None if value is None else _host_value(value)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _url_xor_launch(self) -> EngineConfig:
        if self.url is not None and (self.model is not None or self.command is not None):
            raise ValueError("give either url (a running engine) or model/command, not both")
        if self.url is None and self.model is None and self.command is None:
            raise ValueError("give url (a running engine) or model (to start one)")
        if self.url is not None and self.port is not None:
            raise ValueError("port: a running engine's port is the one in its url")
        if self.url is not None and self.host is not None:
            raise ValueError("host: a running engine's host is the one in its url")
        return self

    @property
    def launched(self) -> bool:
        """True when ``fabric up`` starts this engine (no ``url``)."""
        return self.url is None

    @property
    def address(self) -> str:
        """Where others reach the engine: the url's host, else its host's
        address, else loopback."""
        if self.url is not None:
            return urlsplit(self.url).hostname or LOCAL_HOST
        return self.host_address or LOCAL_HOST

    @property
    def base_url(self) -> str:
        """``http://address:port`` of the engine's OpenAI server."""
        if self.url is not None:
            return self.url
        if self.port is None:
            raise ConfigError(f"{self.name}: port is not set (resolved at launch)")
        return f"http://{self.address}:{self.port}"

    @property
    def kv_endpoint(self) -> str | None:
        """``tcp://address:kv_port`` of the engine's fabric control channel, if known."""
        if self.kv_port is None:
            return None
        return f"tcp://{self.address}:{self.kv_port}"

    @property
    def kv_role(self) -> str:
        """The ``kv_role`` vLLM's kv-transfer-config takes for this role."""
        return {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[self.role]


class ProxyConfig(Settings):
    """The PD proxy: where it listens, its timeouts and its policy.

    ``host``: the address it listens on; in a topology with ``hosts:``, the
    name of the host that runs it (it listens on that host's ``bind``).
    ``port`` None picks a free port. Timeouts bound every wait: connecting to
    an engine, the prefill answer, each read from the decoder (for a stream:
    the gap between two chunks), and health probes; ``request_deadline_s``
    bounds a whole request end to end (a 504, or an error event that ends
    the stream). ``health_interval_s``:
    period of the background health check (0 = off; failures seen on requests
    still mark engines down). ``max_connections``: pool size of the shared
    HTTP client, per engine (the prefill and decode calls go over a small
    keep-alive pool on httptools' parser, :mod:`fabric.router.pool`). ``max_body_bytes``:
    the largest request body the proxy accepts; a larger one gets a 413
    JSON error as soon as its ``Content-Length`` (or the bytes received so
    far) pass the bound, without being buffered. ``max_answer_bytes``: the
    largest non-streamed engine answer the proxy reads (past it: a 502 JSON
    error, or for a prefill a fallback; the engine connection is dropped).
    ``pool_timeout_s``: the longest a request waits for a free pooled
    connection to an engine (None: ``connect_timeout_s``; past it a 503, or
    for a prefill a fallback). ``drain_timeout_s``: on SIGTERM, ``fabric
    up`` (and each engine it started) answers new requests 503 and waits this
    long for the ones in flight before it stops. ``client_keepalive_s``: how
    long a client's idle connection is kept open (whole seconds, at least
    1); keep it above what the clients (or a load balancer in front) keep
    theirs, or a request sent as the proxy closes reads a reset.

    ``policy`` picks prefillers and decoders (:mod:`fabric.router.policy`);
    ``prefill_policy`` / ``decode_policy`` override it for one role.
    ``disaggregate_min_prompt_tokens``: prompts shorter than this go straight
    to a decoder, which computes them itself (0 = always disaggregate). Token
    ids are counted exactly; text is estimated as UTF-8 bytes // 4.
    ``cache_aware`` asks every engine's store (over its ``kv_port``, each
    lookup bounded by ``lookup_timeout_ms``) and picks the one holding the
    longest prefix, unless it has ``cache_aware_max_imbalance`` more
    requests in flight than the least loaded one.

    ``handoff``: ``early`` (default) sends the decoder its request at
    dispatch, with the prefiller's, so its blocks are allocated and filled
    while the prefill runs (:mod:`fabric.router.handoff`); ``sequential``
    sends it only after the prefiller answered. ``early_max_tokens``: the
    estimated prompt tokens one decoder may hold early from this proxy at
    once (0: a quarter of the decoder's KV cache, as its ``/metrics`` reports it;
    no bound until read); past it a request takes the sequential flow.
    ``first_token``: ``prefiller`` streams the token the prefiller sampled
    as soon as it answers, then the decoder's stream from its second token
    (checked against the first); for PD requests (early or sequential
    handoff) of streamed, greedy or
    seeded completions (:mod:`fabric.router.first_token` says which);
    ``decoder`` (default) relays the decoder's own first token.

    ``admin_token_env``: the name of an environment variable holding the
    bearer token that ``POST /fabric/lookup|clear|pin`` require
    (``Authorization: Bearer <token>``); unset: the connector's secret, if
    any (:mod:`fabric.router.admin`). A proxy bound beyond loopback with
    neither refuses to start unless ``connector.insecure``.
    """

    host: str = LOCAL_HOST
    port: Port | None = 8000
    connect_timeout_s: Seconds = 5.0
    request_deadline_s: Seconds = 3600.0
    prefill_timeout_s: Seconds = 600.0
    decode_timeout_s: Seconds = 600.0
    health_timeout_s: Seconds = 2.0
    health_interval_s: Annotated[float, Field(ge=0)] = 5.0
    policy: PolicyName = "round_robin"
    prefill_policy: PolicyName | None = None
    decode_policy: PolicyName | None = None
    disaggregate_min_prompt_tokens: Annotated[int, Field(strict=True, ge=0)] = 0
    max_connections: PositiveInt = 1024
    max_body_bytes: PositiveInt = 32 * 1024 * 1024
    max_answer_bytes: PositiveInt = 64 * 1024 * 1024
    pool_timeout_s: Seconds | None = None
    drain_timeout_s: Annotated[float, Field(ge=0)] = 30.0
    client_keepalive_s: Annotated[float, Field(ge=1)] = 75.0
    lookup_timeout_ms: PositiveInt = 500
    cache_aware_max_imbalance: Annotated[int, Field(strict=True, ge=0)] = 4
    handoff: Literal["early", "sequential"] = "early"
    early_max_tokens: Annotated[int, Field(strict=True, ge=0)] = 0
    first_token: Literal["decoder", "prefiller"] = "decoder"
    admin_token_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")


class TopologyConnectorConfig(Settings):
    """A topology's ``connector:`` section: the fabric connector's settings
    for every engine it starts (each engine's own, after its role and port,
    is :class:`fabric.integrations.vllm.config.ConnectorConfig`).

    Passed to vLLM as ``kv_connector_extra_config`` (see :meth:`extra_config`).
    ``store_slots`` or ``store_mib`` sizes the chunk store (neither: the
    connector's default), ``pool_device`` where the pool lives (None: the
    connector's ``auto``; with a shared store, every engine gets ``host``,
    not only those that keep a reuse tier, so that all agree on host memory).
    ``load_timeout_s``: how long a decoder waits for pushed chunks before
    recomputing (None: the connector's default). ``extra`` is passed through
    verbatim (the connector refuses keys it does not know).

    Reuse tier: ``reuse`` says which engines look their store up before
    computing a prompt and keep the chunks they compute (``all``,
    ``prefill``, ``decode`` or ``none``; a ``both`` engine counts as either).
    ``disk_path`` adds the disk tier: each engine gets ``<disk_path>/<name>``
    (made absolute here), so a restarted engine finds its predecessor's
    chunks; ``disk_gib`` is each engine's disk budget; ``eviction`` the
    policy of both tiers (``lru``).

    ``secret_env``: the name of an environment variable holding the shared
    secret that signs every engine's control channel (the engines and the
    proxy read it; the secret itself never appears in the YAML or on a
    command line). Unset: no signing.

    ``insecure``: let engines, the shared store and the proxy bind beyond
    loopback without a secret (each logs it loudly); without it they refuse.

    ``shared_store``: a shared store already running on this host
    (``host:port`` or its endpoint file), passed to every engine that keeps
    a reuse tier; a top-level ``store:`` section starts one and fills it in.
    """

    chunk_tokens: PositiveInt = 256
    store_slots: PositiveInt | None = None
    store_mib: PositiveInt | None = None
    pool_device: Literal["auto", "host", "cuda", "pinned", "cpu"] | None = None
    transport: Literal["auto", "nixl", "tcp"] = "auto"
    load_timeout_s: Seconds | None = None
    reuse: Literal["all", "prefill", "decode", "none"] = "all"
    disk_path: str | None = None
    disk_gib: Annotated[float, Field(gt=0)] | None = None
    eviction: Literal["lru"] = "lru"
    secret_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    shared_store: str | None = Field(default=None, min_length=1)
    insecure: bool = False
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_store_size(self) -> TopologyConnectorConfig:
        if self.store_slots is not None and self.store_mib is not None:
            raise ValueError("give store_slots or store_mib, not both")
        if self.pool_device == "cuda" and (
            self.shared_store is not None or self.transport == "tcp"
        ):
            raise ValueError(
                "pool_device: 'cuda' with a shared store or the tcp transport, which keep "
                "chunks in host memory; use auto, host or pinned"
            )
        return self

    def resolved_pool_device(self) -> str | None:
        """The ``pool_device`` every engine gets: ``host`` for all of them where
        a shared store makes some engines' ``auto`` host memory (engines without
        a reuse tier would otherwise choose VRAM, and refuse each other)."""
        if self.shared_store is not None and self.pool_device in (None, "auto"):
            return "host"
        return self.pool_device

    def secret(self) -> str | None:
        """The shared secret from ``secret_env`` (None without one); ConfigError if unset."""
        if self.secret_env is None:
            return None
        value = os.environ.get(self.secret_env)
        if not value:
            raise ConfigError(
                f"connector.secret_env: environment variable {self.secret_env!r} is not set"
            )
        return value

    def extra_config(
        self, kv_port: int, host: str = LOCAL_HOST, *, role: Role = "both", name: str = "engine"
    ) -> dict[str, Any]:
        """The ``kv_connector_extra_config`` dict of engine ``name`` (``role``)
        whose channel is ``kv_port``."""
        reuse = self.reuse == "all" or (role in (self.reuse, "both") and self.reuse != "none")
        out: dict[str, Any] = {
            "kv_port": kv_port,
            "host": host,
            "chunk_tokens": self.chunk_tokens,
            "transport": self.transport,
            "reuse": reuse,
        }
        optional = {
            "store_slots": self.store_slots,
            "store_mib": self.store_mib,
            "pool_device": self.resolved_pool_device(),
            "load_timeout_s": self.load_timeout_s,
            "disk_gib": self.disk_gib,
            "secret_env": self.secret_env,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.insecure:
            out["insecure"] = True
        if reuse and self.disk_path is not None:
            out["disk_path"] = str(Path(self.disk_path, name).resolve())
        if reuse and self.shared_store is not None:
            out["shared_store"] = self.shared_store
        return {**out, **self.extra}


class SharedStoreConfig(Settings):
    """The host's shared store that ``fabric up`` starts before the engines.

    ``fabric store serve`` with ``mem_gib`` of memory, an optional disk tier
    (``disk_path``, ``disk_gib``; it survives restarts) and its control
    channel on ``port`` (0: a free one). Its log is ``WORKDIR/logs/store.log``;
    every engine that keeps a reuse tier gets its endpoint as
    ``shared_store``, and it is stopped (by pid) after the engines.
    ``startup_timeout_s`` bounds the wait for its endpoint.
    """

    port: Annotated[int, Field(strict=True, ge=0, le=65535)] = 0
    mem_gib: Annotated[float, Field(gt=0)] = 2.0
    disk_path: str | None = None
    disk_gib: Annotated[float, Field(gt=0)] = 16.0
    startup_timeout_s: Seconds = 60.0


DnsLabel = Annotated[str, Field(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=63)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
# NOTE: a Kubernetes resource quantity ("4", "500m", "16Gi", "1.5").
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$"


class K8sPodConfig(Settings):
    """Size and placement of one kind of pod (``k8s.engine``, ``k8s.engines.NAME``,
    ``k8s.proxy``).

    ``cpu`` / ``memory``: requests, as Kubernetes quantities (``"4"``,
    ``"500m"``, ``"16Gi"``); ``memory`` is the limit too. ``gpus``: devices
    of ``k8s.gpu_resource`` (None: an engine takes the count of its
    ``cuda_visible_devices``, else none). ``rdma``: devices of
    ``k8s.rdma_resource`` (the container also gets ``IPC_LOCK`` to pin
    memory). ``node_selector`` / ``tolerations``: as in a pod spec.
    """

    cpu: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    memory: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    gpus: NonNegativeInt | None = None
    rdma: NonNegativeInt = 0
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity_as_string(cls, value: Any) -> Any:
        # NOTE: YAML reads `cpu: 2` as an int; quantities are strings.
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        return value


class K8sEngineConfig(K8sPodConfig):
    """An engine's pods. ``pods_per_engine`` > 1: the engine spans that many
    pods (a LeaderWorkerSet: the leader serves, the workers join it)."""

    pods_per_engine: PositiveInt = 1


class K8sProxyConfig(K8sPodConfig):
    """The proxy's pods: ``replicas`` of them behind a Service of ``service_type``."""

    replicas: PositiveInt = 1
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"


class K8sConfig(Settings):
    """What ``fabric k8s`` renders for a cluster (the ``k8s:`` section).

    ``image``: an image with fabric and vLLM that the operator builds
    (``fabric:latest`` is only a placeholder); ``python`` its interpreter.
    ``name`` prefixes every object's name (``fabric-decode-0``); objects go
    to ``namespace`` (unset: the one ``kubectl`` uses). ``workdir``: an
    emptyDir in each engine pod (built tiny models, drain files, relative
    disk tiers). ``secret_name`` / ``secret_key``: the Secret holding the
    connector's secret (``admin_token_key``: the proxy's admin token there,
    when ``proxy.admin_token_env`` is set). ``engine``: every engine's pods;
    ``engines``: per engine name, the keys that differ from ``engine``.
    ``overrides``: ``Kind/name`` -> a mapping deep-merged into that rendered
    object (``null`` deletes a key; lists of named items merge by name).
    """

    image: str = Field(default="fabric:latest", min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    namespace: DnsLabel | None = None
    name: Annotated[str, Field(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=40)] = "fabric"
    service_account: str | None = Field(default=None, min_length=1)
    python: str = Field(default="python3", min_length=1)
    workdir: str = Field(default="/fabric", pattern=r"^/")
    secret_name: str = Field(default="fabric-secret", pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
    secret_key: str = Field(default="secret", pattern=r"^[-._a-zA-Z0-9]+$")
    admin_token_key: str = Field(default="admin-token", pattern=r"^[-._a-zA-Z0-9]+$")
    gpu_resource: str = Field(default="nvidia.com/gpu", min_length=1)
    rdma_resource: str = Field(default="rdma/ib", min_length=1)
    prometheus: bool = True
    engine: K8sEngineConfig = Field(default_factory=K8sEngineConfig)
    engines: dict[str, K8sEngineConfig] = Field(default_factory=dict)
    proxy: K8sProxyConfig = Field(default_factory=K8sProxyConfig)
    overrides: dict[Annotated[str, Field(pattern=r"^[A-Za-z]+/[-.a-z0-9]+$")], dict[str, Any]] = (
        Field(default_factory=dict)
    )

    def engine_pods(self, name: str) -> K8sEngineConfig:
        """Engine ``name``'s pods: ``engine`` with what ``engines.NAME`` sets."""
        override = self.engines.get(name)
        if override is None:
            return self.engine
        update = {key: getattr(override, key) for key in override.model_fields_set}
        return self.engine.model_copy(update=update)


class TopologyConfig(Settings):
    """A whole PD deployment: engines, proxy, connector and a work directory.

    Engine entries may omit ``role`` (taken from the list they are in),
    ``name`` (``prefill-0``, ``decode-1``...) and ``model`` (``model`` here).
    ``startup_timeout_s`` bounds ``fabric up``'s wait for healthy engines.
    ``store``: a shared store ``fabric up`` starts first (see
    :class:`SharedStoreConfig`; across hosts, one on each host that runs
    an engine with a reuse tier).

    ``hosts``: the machines of a topology that spans hosts, by name (see
    :class:`HostConfig`). With it, the proxy's ``host`` names the one that
    runs the proxy, an engine that runs on another host than the proxy needs
    its ``port`` and ``kv_port`` (a free port picked there cannot be told to
    the proxy), and beyond loopback the connector needs ``secret_env`` (the
    same secret on every host) or ``insecure``.
    """

    model: str | None = None
    workdir: str = "work"
    hosts: dict[str, HostConfig] = Field(default_factory=dict)
    prefill: list[EngineConfig]
    decode: list[EngineConfig]
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    connector: TopologyConnectorConfig = Field(default_factory=TopologyConnectorConfig)
    store: SharedStoreConfig | None = None
    startup_timeout_s: Seconds = 600.0
    k8s: K8sConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _fill_engine_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        hosts = data.get("hosts")
        addresses = _raw_addresses(hosts) if isinstance(hosts, dict) else {}
        for role in ("prefill", "decode"):
            entries = data.get(role)
            if isinstance(entries, list):
                data[role] = [
                    _engine_defaults(e, role, i, data.get("model"), addresses)
                    for i, e in enumerate(entries)
                ]
        return data

    @model_validator(mode="after")
    def _check_topology(self) -> TopologyConfig:
        for role in ("prefill", "decode"):
            if not getattr(self, role):
                raise ValueError(f"{role}: at least one {role} engine is needed")
        for path, engine in self.engines_with_paths():
            listed = path.split("[")[0]
            allowed = (listed, "both")
            if engine.role not in allowed:
                raise ValueError(f"{path}.role: {engine.role!r} engine in the {listed} list")
        _check_unique_names(self)
        _check_unique_ports(self)
        _check_store(self)
        _check_hosts(self)
        return self

    def host_name(self, host: str | None) -> str | None:
        """The ``hosts:`` name that ``host`` (a name or an address) stands for;
        None when none does."""
        if host is None:
            return None
        if host in self.hosts:
            return host
        return next((name for name, e in self.hosts.items() if e.address == host), None)

    def engines_on(self, host: str) -> list[EngineConfig]:
        """The engines ``fabric up --host HOST`` starts (``HOST`` a ``hosts:`` name)."""
        return [e for e in self.engines if e.launched and self.host_name(e.host) == host]

    @property
    def proxy_host(self) -> str | None:
        """The ``hosts:`` name of the host that runs the proxy (None: no ``hosts:``)."""
        return self.host_name(self.proxy.host)

    @property
    def proxy_address(self) -> str:
        """Where others reach the proxy: its host's address, else ``proxy.host``."""
        name = self.proxy_host
        return self.hosts[name].address if name is not None else self.proxy.host

    @property
    def proxy_bind(self) -> str:
        """The address the proxy listens on."""
        name = self.proxy_host
        return self.hosts[name].bind_host if name is not None else self.proxy.host

    @property
    def spans_hosts(self) -> bool:
        """Whether ``hosts:`` places anything beyond loopback."""
        return any(not entry.loopback for entry in self.hosts.values())

    @property
    def engines(self) -> list[EngineConfig]:
        """Every engine, prefillers first."""
        return [*self.prefill, *self.decode]

    def engines_with_paths(self) -> Iterator[tuple[str, EngineConfig]]:
        """``("prefill[0]", engine)``... for messages that name the entry."""
        for role in ("prefill", "decode"):
            for i, engine in enumerate(getattr(self, role)):
                yield f"{role}[{i}]", engine

    @property
    def workdir_path(self) -> Path:
        """``workdir`` as an absolute path (relative to the current directory)."""
        return Path(self.workdir).expanduser().resolve()


def load_topology(path: str | os.PathLike[str]) -> TopologyConfig:
    """Read and validate a topology YAML; every problem is a ``ConfigError``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    return parse_topology(data, source=str(path))


def parse_topology(data: Any, source: str = "<topology>") -> TopologyConfig:
    """Validate an already-parsed topology (a dict); errors name ``source`` and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        with validating_whole():
            return TopologyConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from exc


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One ``source: field.path: message`` line per pydantic error."""
    lines = []
    for err in exc.errors(include_url=False):
        msg = str(err["msg"]).removeprefix("Value error, ")
        where = field_path(err["loc"])
        lines.append(f"{source}: {where}: {msg}" if where else f"{source}: {msg}")
    return "\n".join(lines)


def _engine_defaults(
    entry: Any, role: str, index: int, model: Any, addresses: dict[str, str]
) -> Any:
    if not isinstance(entry, dict):
        return entry
    if "host_address" in entry:
        raise ValueError(f"{role}[{index}].host_address: derived from host, not a setting")
    entry = {"name": f"{role}-{index}", "role": role, **entry}
    if model is not None and not {"url", "model"} & entry.keys():
        entry["model"] = model
    host = entry.get("host")
    if isinstance(host, str):
        entry["host_address"] = addresses.get(host, host)
    return entry


def _raw_addresses(hosts: dict[Any, Any]) -> dict[str, str]:
    """``name -> address`` of the (not yet validated) ``hosts:`` entries that have one."""
    return {
        name: entry["address"]
        for name, entry in hosts.items()
        if isinstance(entry, dict) and isinstance(entry.get("address"), str)
    }


def _check_hosts(topology: TopologyConfig) -> None:
    """A topology with ``hosts:``: the proxy's host is one of them, engines away
    from the proxy have fixed ports, and beyond loopback there is a secret."""
    if not topology.hosts:
        for path, engine in topology.engines_with_paths():
            if engine.host is not None:
                raise ValueError(f"{path}.host: {engine.host!r}, but the topology has no hosts:")
        return
    names = ", ".join(topology.hosts)
    proxy_host = topology.proxy_host
    if topology.proxy.port is None:
        raise ValueError(
            "proxy.port: a topology across hosts needs a fixed proxy port (the other "
            "hosts tell fabric status where the proxy is)"
        )
    if proxy_host is None:
        raise ValueError(
            f"proxy.host: {topology.proxy.host!r} is none of hosts: ({names}); name the "
            "host that runs the proxy"
        )
    for path, engine in topology.engines_with_paths():
        if not engine.launched:
            continue
        if engine.host is None:
            raise ValueError(f"{path}.host: missing; name the host that runs it ({names})")
        host = topology.host_name(engine.host)
        if host is None:
            raise ValueError(f"{path}.host: {engine.host!r} is none of hosts: ({names})")
        if host != proxy_host:
            for field in ("port", "kv_port"):
                if getattr(engine, field) is None:
                    raise ValueError(
                        f"{path}.{field}: {engine.name} runs on {host} and the proxy "
                        f"on {proxy_host}: give its {field} (one picked free on "
                        f"{host} cannot be told to the proxy)"
                    )
    connector = topology.connector
    if topology.spans_hosts and connector.secret_env is None and not connector.insecure:
        raise ValueError(
            "connector.secret_env: a topology across hosts needs a shared secret (the "
            "same one in this environment variable on every host; make one with: python "
            "-c 'import secrets; print(secrets.token_hex(32))'), or connector.insecure: true"
        )


def _host_value(value: str) -> str:
    """An address or a name for a host field; IPv6 is refused (fabric speaks IPv4)."""
    from fabric.transfer.addresses import check_host

    try:
        return check_host(value, "host")
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("host: ")) from exc


def _env_strings(value: Any) -> Any:
    # NOTE: YAML reads `FOO: 1` as an int; environment values are strings.
    if isinstance(value, dict):
        return {k: _scalar_str(v) for k, v in value.items()}
    return value


def _check_unique_names(topology: TopologyConfig) -> None:
    seen: dict[str, str] = {}
    for path, engine in topology.engines_with_paths():
        if engine.name in seen:
            raise ValueError(
                f"{path}.name: {engine.name!r} is also the name of {seen[engine.name]}"
            )
        seen[engine.name] = path


def _check_unique_ports(topology: TopologyConfig) -> None:
    seen: dict[tuple[str, int], str] = {}
    used: list[tuple[str, str, int | None]] = [
        ("proxy.port", topology.proxy_address, topology.proxy.port)
    ]
    for path, engine in topology.engines_with_paths():
        used += [
            (f"{path}.port", engine.address, engine.port),
            (f"{path}.kv_port", engine.address, engine.kv_port),
        ]
    if topology.store is not None and topology.store.port:
        used.append(("store.port", LOCAL_HOST, topology.store.port))
    for where, host, port in used:
        if port is None:
            continue
        key = (_host_key(host), port)
        if key in seen:
            raise ValueError(f"{where}: port {port} is already used by {seen[key]}")
        seen[key] = where


def _check_store(topology: TopologyConfig) -> None:
    if topology.store is None:
        return
    if topology.connector.shared_store is not None:
        raise ValueError(
            "store: fabric up starts a shared store, and connector.shared_store names "
            "another; give one of them"
        )
    if topology.connector.reuse == "none":
        raise ValueError("store: a shared store needs engines with a reuse tier (connector.reuse)")
    if topology.connector.pool_device == "cuda":
        raise ValueError(
            "store: a shared store keeps chunks in host memory, and connector.pool_device "
            "'cuda' puts the engines' pools in VRAM; use auto, host or pinned"
        )


def _host_key(host: str) -> str:
    return LOCAL_HOST if host in ("localhost", "0.0.0.0", "::1") else host


def _scalar_str(value: Any) -> Any:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float):
        return str(value)
    return value
