"""Cache identity on real vLLM: the same token ids under another ``cache_salt``,
another LoRA adapter or other model weights never load each other's KV.

Three engines, each serving the base model and two random rank-8 adapters
on ``k_proj``/``v_proj`` (``loraA``, ``loraB``; they change the KV of every
token), vLLM's own prefix cache off (but on the oracle's) so that only
fabric can answer a repeat:

    colocated   no connector: the oracle for every output (computed in one
                prefill, or with the prefix in vLLM's own prefix cache)
    store       kv_both, memory + disk tier; the reuse engine, and the
                proxy's prefiller
    decode      kv_consumer: the proxy's decoder

``store`` first runs on a seed-0 model and computes a prompt into its disk
tier; it is stopped, its model directory is rebuilt in place with seed 1
(the weights ``colocated`` serves), and it starts again on the same disk
directory: the old chunks must not be loaded for the new weights.

A hit is ``vllm:fabric_store_hit_tokens_total`` moving on the engine that
looks up its store (the prefiller, over PD). Over PD, the chunks the
decoder already holds are not written again: the prefiller's
``vllm:fabric_bytes_sent_total`` shows what the decoder lacked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fabric.launch.process import free_port
from fabric.testing.models import make_tiny_lora, make_tiny_model
from fabric.testing.models.tiny import WEIGHTS_NAME
from tests.e2e._engines import Engine, EngineFactory
from tests.e2e._pd import (
    CHUNK_TOKENS,
    Proxy,
    assert_same,
    body,
    complete,
    kv_config,
    metric,
    prompt_ids,
)

# NOTE: three engines start at once here, often beside other engineers' runs;
# the first test's budget covers the fixture's two rounds of engine starts.
START_TIMEOUT_S = 480.0
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2 * START_TIMEOUT_S + 300)]

FULL_CHUNKS = 3
TAIL = 40
PROMPT_LEN = FULL_CHUNKS * CHUNK_TOKENS + TAIL
HIT_TOKENS = FULL_CHUNKS * CHUNK_TOKENS  # vLLM computes the tail itself
BASE = "tiny"
ADAPTERS = ("loraA", "loraB")
OLD_SEED, NEW_SEED = 0, 1
COUNTERS = (
    "store_hit_tokens",
    "chunks_saved",
    "disk_hit_chunks",
    "bytes_sent",
    "chunks_sent",
    "loads_ok",
    "load_failures",
)
SETTLE_S = 10.0

Output = tuple[list[int], list[float]]
T = TypeVar("T")


def request(prompt: list[int], model: str = BASE, salt: str | None = None) -> dict[str, Any]:
    """A greedy completions body for ``model`` (the base or an adapter)."""
    payload = body(prompt) | {"model": model}
    if salt is not None:
        payload["cache_salt"] = salt
    return payload


def fabric_counters(engine: Engine) -> dict[str, float]:
    """The fabric counters of ``engine`` once they stopped moving.

    NOTE: a worker hands its counts to vLLM only when the engine runs a
    step, and a push finishes on fabric's thread after the prefiller's
    one-token answer: a one-token request makes the engine step, and the
    counters are read until two reads agree.
    """
    complete(engine.url("/v1/completions"), body([1, 2, 3]) | {"max_tokens": 1})
    deadline = time.monotonic() + SETTLE_S
    last = _read(engine)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = _read(engine)
        if now == last:
            return now
        last = now
    return last


def _read(engine: Engine) -> dict[str, float]:
    return {name: metric(engine.base_url, f"vllm:fabric_{name}_total") for name in COUNTERS}


def measured(
    run: Callable[[], T], engines: dict[str, Engine]
) -> tuple[T, dict[str, dict[str, float]]]:
    """``run()``'s result and, per role, how much each fabric counter moved."""
    before = {role: fabric_counters(engine) for role, engine in engines.items()}
    result = run()
    after = {role: fabric_counters(engine) for role, engine in engines.items()}
    moved = {
        role: {name: after[role][name] - before[role][name] for name in COUNTERS}
        for role in engines
    }
    return result, moved


@dataclass
class Step:
    """One request of a test: its answer, the oracle's, and what it moved
    (``moved["p"]``: the store engine, ``moved["d"]``: the decoder, over PD)."""

    label: str
    output: Output
    want: Output
    moved: dict[str, dict[str, float]]
    want_cached: Output | None = None  # vLLM's own answer from its prefix cache

    @property
    def same_tokens(self) -> bool:
        return self.output[0] == self.want[0]


def chunk_files(disk: Path) -> set[Path]:
    return set(disk.rglob("*.chunk"))


def wait_for_files(disk: Path, count: int, timeout: float = 60) -> set[Path]:
    """The disk tier writes behind the model step: wait for ``count`` chunk files."""
    deadline = time.monotonic() + timeout
    while len(files := chunk_files(disk)) < count:
        assert time.monotonic() < deadline, f"{len(files)} of {count} chunk files written"
        time.sleep(0.2)
    return files


@dataclass
class OldPrompt:
    """What ``store`` computed on the seed-0 model before the rebuild."""

    prompt: list[int]
    output: Output
    files: set[Path]


@dataclass
class Cluster:
    colocated: Engine
    store: Engine
    decode: Engine
    proxy: Proxy
    disk: Path
    old: OldPrompt
    oracle: dict[tuple[tuple[int, ...], str, str | None], Output] = field(default_factory=dict)

    cached: dict[tuple[tuple[int, ...], str, str | None], Output] = field(default_factory=dict)

    def want(self, prompt: list[int], model: str = BASE, salt: str | None = None) -> Output:
        """The colocated engine's answer, the prompt computed in one prefill
        (asked once per prompt, model and salt)."""
        key = (tuple(prompt), model, salt)
        if key not in self.oracle:
            url = self.colocated.url("/v1/completions")
            self.oracle[key] = complete(url, request(prompt, model, salt))
        return self.oracle[key]

    def want_cached(self, prompt: list[int], model: str = BASE, salt: str | None = None) -> Output:
        """The colocated engine's answer with the prompt's prefix in vLLM's own
        prefix cache: the same request again after :meth:`want`.

        NOTE: vLLM's numerics for a cached prefix and a computed tail differ
        from one prefill's: on an AVX2-only CPU (bf16 without hardware
        support) a LoRA adapter's answer moved by 0.03, bit for bit what
        fabric's hit gave, so a hit is held to this answer too.
        """
        self.want(prompt, model, salt)
        key = (tuple(prompt), model, salt)
        if key not in self.cached:
            url = self.colocated.url("/v1/completions")
            self.cached[key] = complete(url, request(prompt, model, salt))
        return self.cached[key]

    def step(
        self,
        label: str,
        prompt: list[int],
        model: str = BASE,
        salt: str | None = None,
        *,
        pd: bool = False,
    ) -> Step:
        """Send the request to the store engine (or through the proxy, ``pd``)
        and measure it."""
        front = self.proxy.url("/v1/completions") if pd else self.store.url("/v1/completions")
        roles = {"p": self.store, "d": self.decode} if pd else {"p": self.store}
        output, moved = measured(partial(complete, front, request(prompt, model, salt)), roles)
        want, cached = self.want(prompt, model, salt), self.want_cached(prompt, model, salt)
        return Step(label, output, want, moved, cached)


def lora_args(adapters: dict[str, Path]) -> list[str]:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", *modules]


class Starter:
    """Starts this module's three roles, all serving the base model and both adapters."""

    def __init__(self, engines: EngineFactory, adapters: dict[str, Path], disk: Path) -> None:
        self.engines, self.disk = engines, disk
        self.lora = lora_args(adapters)
        self.args = [*self.lora, "--no-enable-prefix-caching"]
        self.store_port, self.decode_port = free_port(), free_port()

    def colocated(self, model_dir: Path) -> Engine:
        # NOTE: its own prefix cache on: a repeat is vLLM's answer for a hit
        return self._start(model_dir, "colocated", "1", None, lora_only=True)

    def store(self, model_dir: Path) -> Engine:
        config = kv_config(
            "kv_both", kv_port=self.store_port, store_mib=64, disk_path=str(self.disk), disk_gib=1
        )
        return self._start(model_dir, "store", "0", config)

    def decode(self, model_dir: Path) -> Engine:
        config = kv_config("kv_consumer", kv_port=self.decode_port, store_mib=64)
        return self._start(model_dir, "decode", "1", config)

    def _start(
        self,
        model_dir: Path,
        name: str,
        cores: str,
        config: dict[str, Any] | None,
        *,
        lora_only: bool = False,
    ) -> Engine:
        return self.engines.start(
            model_dir,
            name=name,
            cpu_cores=cores,
            kv_transfer_config=config,
            extra_args=self.lora if lora_only else self.args,
            timeout=START_TIMEOUT_S,
        )


def compute_old_prompt(store: Engine, disk: Path) -> OldPrompt:
    prompt = prompt_ids(PROMPT_LEN, seed=900)
    output = complete(store.url("/v1/completions"), request(prompt))
    return OldPrompt(prompt, output, wait_for_files(disk, FULL_CHUNKS))


@pytest.fixture(scope="module")
def cluster(engines: EngineFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("identity")
    model_dir = make_tiny_model(root / "model", seed=NEW_SEED)
    store_dir = make_tiny_model(root / "rebuilt", seed=OLD_SEED)
    adapters = {
        name: make_tiny_lora(root / name, model_dir, seed=10 + i) for i, name in enumerate(ADAPTERS)
    }
    starter = Starter(engines, adapters, root / "disk")
    with ThreadPoolExecutor(3) as pool:
        colocated = pool.submit(starter.colocated, model_dir)
        old_store = pool.submit(starter.store, store_dir)
        old = compute_old_prompt(old_store.result(), starter.disk)
        old_store.result().process.stop()
        # NOTE: in place, same path and config: only the weights differ.
        make_tiny_model(store_dir, seed=NEW_SEED)
        assert (store_dir / WEIGHTS_NAME).read_bytes() == (model_dir / WEIGHTS_NAME).read_bytes()
        store = pool.submit(starter.store, store_dir)
        decode = pool.submit(starter.decode, model_dir)
        started = colocated.result(), store.result(), decode.result()
    proxy = Proxy([started[1].base_url], [(started[2].base_url, starter.decode_port)])
    try:
        yield Cluster(*started, proxy, starter.disk, old)
    finally:
        proxy.stop()


def observed(steps: list[Step], fields: dict[str, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Per step: ``{field: moved[role][counter]}`` for ``fields = {field: (role,
    counter)}``, and whether its tokens equal the colocated engine's."""
    return {
        step.label: {name: step.moved[role][counter] for name, (role, counter) in fields.items()}
        | {"tokens_as_colocated": step.same_tokens}
        for step in steps
    }


def assert_outputs(steps: list[Step]) -> None:
    """Each step's output equals the colocated engine's, computed in one
    prefill or (vLLM's own numerics for a hit) with the prefix in its own
    prefix cache; a failure names every step that differs and how."""
    differ = {}
    for step in steps:
        try:
            assert_same(step.output, step.want)
        except AssertionError:
            if step.want_cached is not None and _same(step.output, step.want_cached):
                continue
            gap = max(abs(g - w) for g, w in zip(step.output[1], step.want[1], strict=False))
            differ[step.label] = {"same_tokens": step.same_tokens, "max_logprob_gap": gap}
    assert not differ, f"outputs unlike the colocated engine's: {differ}; moved: " + str(
        {step.label: step.moved for step in steps if step.label in differ}
    )


def _same(got: Output, want: Output) -> bool:
    try:
        assert_same(got, want)
    except AssertionError:
        return False
    return True


def test_rebuilt_model_does_not_load_the_old_disk_chunks(cluster: Cluster) -> None:
    """Same path, same served name, same token ids: seed-1 weights must not
    load the chunks the seed-0 weights left on disk."""
    old = cluster.old
    want = cluster.want(old.prompt)
    assert old.output[0] != want[0], "seed 0 and seed 1 answer alike: the test proves nothing"
    assert chunk_files(cluster.disk) >= old.files  # still there after the restart
    steps = [cluster.step("seed-1 engine, seed-0 prompt again", old.prompt)]
    seen = observed(
        steps,
        {"disk_hit_chunks": ("p", "disk_hit_chunks"), "hit_tokens": ("p", "store_hit_tokens")},
    )
    assert seen == {
        steps[0].label: {"disk_hit_chunks": 0, "hit_tokens": 0, "tokens_as_colocated": True}
    }, f"the rebuilt model loaded the old model's disk chunks: {seen}"
    assert_outputs(steps)


def test_cache_salt_keeps_tenants_apart_in_the_store(cluster: Cluster) -> None:
    prompt = prompt_ids(PROMPT_LEN, seed=910)
    steps = [
        cluster.step("A", prompt, salt="tenant-A"),
        cluster.step("B after A", prompt, salt="tenant-B"),
        cluster.step("A again", prompt, salt="tenant-A"),
    ]
    seen = observed(steps, {"hit_tokens": ("p", "store_hit_tokens")})
    assert seen == {
        "A": {"hit_tokens": 0, "tokens_as_colocated": True},
        "B after A": {"hit_tokens": 0, "tokens_as_colocated": True},
        "A again": {"hit_tokens": HIT_TOKENS, "tokens_as_colocated": True},
    }, f"salt B must not load salt A's chunks; store hits by salt: {seen}"
    assert steps[0].moved["p"]["chunks_saved"] == FULL_CHUNKS, steps[0].moved
    assert_outputs(steps)


def test_cache_salt_keeps_tenants_apart_over_pd(cluster: Cluster) -> None:
    """P must not reuse salt A's chunks for B, and D must not take A's
    chunks as B's: P writes every byte of B's prompt again."""
    prompt = prompt_ids(PROMPT_LEN, seed=920)
    steps = [
        cluster.step("A", prompt, salt="tenant-A", pd=True),
        cluster.step("B after A", prompt, salt="tenant-B", pd=True),
        cluster.step("A again", prompt, salt="tenant-A", pd=True),
    ]
    full_bytes = steps[0].moved["p"]["bytes_sent"]
    assert full_bytes > 0, steps[0].moved
    fields = {
        "p_hit_tokens": ("p", "store_hit_tokens"),
        "p_bytes_sent": ("p", "bytes_sent"),
        "d_loads_ok": ("d", "loads_ok"),
    }
    seen = observed(steps, fields)
    ok = {"d_loads_ok": 1, "tokens_as_colocated": True}
    assert seen == {
        "A": {"p_hit_tokens": 0, "p_bytes_sent": full_bytes} | ok,
        "B after A": {"p_hit_tokens": 0, "p_bytes_sent": full_bytes} | ok,
        "A again": {"p_hit_tokens": HIT_TOKENS, "p_bytes_sent": 0} | ok,
    }, f"P's store hits, bytes P wrote to D (what D lacked) and D's loads, by salt: {seen}"
    assert_outputs(steps)


def test_lora_adapters_do_not_share_kv_in_the_store(cluster: Cluster) -> None:
    prompt = prompt_ids(PROMPT_LEN, seed=930)
    wants = [cluster.want(prompt, model) for model in (BASE, *ADAPTERS)]
    assert len({tuple(ids) for ids, _ in wants}) == 3, "the adapters change nothing"
    order = [BASE, *ADAPTERS, BASE, *ADAPTERS]
    steps = [cluster.step(f"{i}: {model}", prompt, model) for i, model in enumerate(order, start=1)]
    seen = observed(steps, {"hit_tokens": ("p", "store_hit_tokens")})
    message = f"store hits across base and adapters on the same token ids: {seen}"
    first, repeat = list(seen.values())[:4], list(seen.values())[4:]
    assert first == [
        {"hit_tokens": 0, "tokens_as_colocated": True},
        {"hit_tokens": 0, "tokens_as_colocated": True},
        {"hit_tokens": 0, "tokens_as_colocated": True},
        {"hit_tokens": HIT_TOKENS, "tokens_as_colocated": True},  # the base repeat hits
    ], message
    # NOTE: an adapter's own repeat may hit (keyed by adapter) or not (bypassed).
    assert all(s["hit_tokens"] in (0, HIT_TOKENS) and s["tokens_as_colocated"] for s in repeat), (
        message
    )
    assert_outputs(steps)


def test_lora_adapters_do_not_share_kv_over_pd(cluster: Cluster) -> None:
    prompt = prompt_ids(PROMPT_LEN, seed=940)
    steps = [cluster.step(model, prompt, model, pd=True) for model in (BASE, *ADAPTERS)]
    seen = observed(
        steps, {"p_hit_tokens": ("p", "store_hit_tokens"), "d_loads_ok": ("d", "loads_ok")}
    )
    expected = {"p_hit_tokens": 0, "d_loads_ok": 1, "tokens_as_colocated": True}
    assert seen == {model: expected for model in (BASE, *ADAPTERS)}, (
        f"P's store hits and D's loads, in order base, loraA, loraB: {seen}"
    )
    assert_outputs(steps)
