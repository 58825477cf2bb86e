"""Fuzzing the proxy: malformed and hostile requests get OpenAI-style 4xx errors.

Thousands of bad requests (broken JSON, non-UTF-8 bytes, deep nesting, wrong
types, out-of-range numbers, unknown fields) go to the generation routes and
the ``/fabric/lookup|pin|clear`` admin routes of a proxy over fake engines
whose stores are real (signed with a shared secret from ``secret_env``).
Every answer must be a 4xx with a JSON error body, never a 5xx or a hang,
and correct requests interleaved with them must keep working.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from fabric.config import parse_topology
from fabric.launch.process import free_port
from fabric.store import ChunkStore, StoreConfig
from fabric.store.tier import TieredStore
from fabric.transfer import TransferConfig, TransferNode

from .conftest import StartEngine
from .servers import FakeEngine, Proxy, ServerThread
from .test_pd_flow import expected_text

SECRET_ENV = "FABRIC_FUZZ_SECRET"
SECRET = "router-fuzz-secret"
AUTH = {"authorization": f"Bearer {SECRET}"}  # the admin token: the connector secret
CT = 4
PROMPT_IDS = list(range(100, 100 + 3 * CT))
NUM_RANDOM = 3000
CHECK_EVERY = 150

GOOD: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "fake", "prompt": "hello there", "max_tokens": 3},
    "/v1/chat/completions": {
        "model": "fake",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
    },
}
ADMIN = ("/fabric/lookup", "/fabric/pin", "/fabric/clear")

# Values each field must refuse (None means "explicit null").
BAD_VALUES: dict[str, list[Any]] = {
    "model": [5, "", [], {}, True, 1.5],
    "prompt": [
        5,
        5.5,
        True,
        {},
        [],
        [None],
        [1.5],
        ["a", 1],
        [[]],
        [{}],
        [-1],
        [2**31],
        [10**30],
        [[1, "a"]],
        [True],
        [[2**40]],
    ],
    "messages": [
        "hi",
        5,
        {},
        [],
        [1],
        ["x"],
        [{}],
        [None],
        [[]],
        [{"role": 5}],
        [{"role": "user", "content": 5}],
        [{"content": "no role"}],
    ],
    "max_tokens": ["5", -1, 0, 10**30, 2**31, 1.5, True, [], {}, float("inf")],
    "min_tokens": [-1, "x", 1.5, True, 2**31],
    "stream": ["true", 1, 0, [], {}],
    "stream_options": ["x", 5, [], True],
}
GENERATION_FIELDS = {
    "/v1/completions": ("model", "prompt", "max_tokens", "min_tokens", "stream", "stream_options"),
    "/v1/chat/completions": (
        "model",
        "messages",
        "max_tokens",
        "min_tokens",
        "stream",
        "stream_options",
    ),
}
ADMIN_BAD: list[dict[str, Any]] = [
    {"engine": 5},
    {"engine": []},
    {"engine": True},
    {"engine": "nope", "prompt": PROMPT_IDS},
    {"tier": 5},
    {"tier": "x"},
    {"tier": None},
    {"tier": []},
    {"prompt": PROMPT_IDS, "pin": "yes"},
    {"prompt": PROMPT_IDS, "pin": None},
    {"prompt": 5},
    {"prompt": {}},
    {"prompt": []},
    {"prompt": [None]},
    {"prompt": ["a", "b"]},
    {"prompt": [2**40]},
    {"prompt": [-1, 2]},
    {"prompt": [10**30]},
    {"prompt": [1.5]},
    {"messages": "x"},
    {"messages": []},
    {"messages": [1]},
    {"messages": [{}]},
    {"prompt": PROMPT_IDS, "unknown_field": 1},
    {"prompt": PROMPT_IDS, "engnie": "p0"},
]
RAW_BAD: list[bytes] = [
    b" ",
    b"{",
    b"}",
    b"null",
    b"[]",
    b"[1]",
    b'"x"',
    b"1",
    b"true",
    b"\xff\xfe",
    b"\x00" * 10,
    b"[" * 100_000,
    b'{"a":' * 20_000,
    b'{"model": "fake", "prompt": "\xff\xfe"}',
    b'{"model": "fake", "prompt": "x", "max_tokens": NaN}',
    b'{"model": "fake", "prompt": "x", "max_tokens": Infinity}',
    b'{"model": "fake", "prompt": "x", "temperature": 1e400}',
    b'{"model": "fake", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"model": "fake", "prompt": [' + b"[" * 5000 + b"1" + b"]" * 5000 + b"]}",
    b'{"model": "fake", "prompt": "x"' + b"\x00" * 100,
    '{"model": "fake", "prompt": "\\ud800"}'.encode("utf-16"),
]


# ------------------------------------------------------------------ rig


class Store:
    """One engine's real store behind its signed control channel."""

    def __init__(self) -> None:
        self.store = ChunkStore(StoreConfig(slot_bytes=256, num_slots=16))
        self.tier = TieredStore(self.store, chunk_tokens=CT, fingerprint="fuzz-model")
        self.port = free_port()
        config = TransferConfig(transport="loopback", port=self.port, secret=SECRET)
        self.node = TransferNode(self.store, config, "fuzz-model", tier=self.tier)
        for key in self.tier.keys(PROMPT_IDS)[:2]:
            slot = self.store.allocate(key)
            self.store.commit(slot, key, 64)

    def close(self) -> None:
        self.node.close()
        self.tier.close()


@dataclass
class Rig:
    proxy: Proxy
    prefill: FakeEngine
    decode: FakeEngine
    stores: list[Store]


@pytest.fixture
def rig(
    start_engine: StartEngine, servers: list[ServerThread], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Rig]:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    stores = [Store(), Store()]
    p, d = start_engine("prefill"), start_engine("decode")
    data = {
        "prefill": [{"name": "p0", "url": p.url, "kv_port": stores[0].port}],
        "decode": [{"name": "d0", "url": d.url, "kv_port": stores[1].port}],
        "proxy": {"port": None, "health_interval_s": 0, "lookup_timeout_ms": 2000},
        "connector": {"secret_env": SECRET_ENV},
    }
    proxy = Proxy(parse_topology(data, source="fuzz")).start()
    servers.append(proxy)
    yield Rig(proxy, p, d, stores)
    for store in stores:
        store.close()


# ------------------------------------------------------------------ cases


def bad_generation(rng: random.Random, path: str) -> bytes:
    """A request body the proxy must refuse."""
    kind = rng.randrange(5)
    good = json.dumps(GOOD[path]).encode()
    if kind == 0:
        return rng.choice(RAW_BAD)
    if kind == 1:
        return good[: rng.randrange(1, len(good))]
    if kind == 2:
        return rng.randbytes(rng.randrange(1, 64))
    body = dict(GOOD[path])
    field = rng.choice(GENERATION_FIELDS[path])
    body[field] = rng.choice(BAD_VALUES[field])
    if field == "stream_options":
        body["stream"] = True
    if kind == 4:  # and some noise the proxy passes on
        body[f"x_{rng.randrange(99)}"] = rng.choice([None, 1, "v", [1], {"a": 1}])
    return json.dumps(body).encode()


def bad_admin(rng: random.Random) -> bytes:
    if rng.random() < 0.4:
        return rng.choice(RAW_BAD)
    return json.dumps(rng.choice(ADMIN_BAD)).encode()


def check_error(response: httpx.Response, what: str) -> None:
    assert 400 <= response.status_code < 500, f"{what}: {response.status_code} {response.text}"
    assert response.headers["content-type"].startswith("application/json"), what
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], what
    assert error["code"] == response.status_code and isinstance(error["type"], str), what


def check_serving(client: httpx.Client, rig: Rig) -> None:
    for path, body in GOOD.items():
        response = client.post(rig.proxy.url + path, json=body)
        assert response.status_code == 200, response.text
        if path == "/v1/completions":
            assert response.json()["choices"][0]["text"] == expected_text(body)
    lookup = client.post(
        rig.proxy.url + "/fabric/lookup", json={"prompt": PROMPT_IDS}, headers=AUTH
    )
    assert lookup.status_code == 200, lookup.text
    hits = {e["name"]: e for e in lookup.json()["engines"]}
    assert hits["p0"]["error"] is None and hits["p0"]["hit_tokens"] == 2 * CT, hits


# ------------------------------------------------------------------ tests


def test_every_listed_bad_value_is_refused(rig: Rig, client: httpx.Client) -> None:
    check_serving(client, rig)
    for path in GOOD:
        for raw in [b"", *RAW_BAD]:
            check_error(client.post(rig.proxy.url + path, content=raw), f"{path} {raw[:40]!r}")
        for field in GENERATION_FIELDS[path]:
            for value in BAD_VALUES[field]:
                body = {**GOOD[path], field: value}
                if field == "stream_options":
                    body["stream"] = True
                response = client.post(rig.proxy.url + path, content=json.dumps(body))
                check_error(response, f"{path} {field}={value!r}")
            missing = {k: v for k, v in GOOD[path].items() if k != field}
            if field in ("model", "prompt", "messages"):
                response = client.post(rig.proxy.url + path, json=missing)
                check_error(response, f"{path} without {field}")
    for path in ADMIN:
        for raw in RAW_BAD:
            response = client.post(rig.proxy.url + path, content=raw, headers=AUTH)
            check_error(response, f"{path} {raw[:40]!r}")
        for body in ADMIN_BAD:
            if path == "/fabric/clear" and ("prompt" in body or "messages" in body):
                body = {k: v for k, v in body.items() if k not in ("prompt", "messages", "pin")}
                body = body or {"tier": 7}
            response = client.post(rig.proxy.url + path, json=body, headers=AUTH)
            check_error(response, f"{path} {body}")
            assert response.status_code != 401, f"{path} {body}: the token was refused"
    check_serving(client, rig)
    assert rig.decode.seen and all(s["body"]["model"] == "fake" for s in rig.decode.seen)


def test_random_bad_requests_never_5xx_and_never_hang(rig: Rig, client: httpx.Client) -> None:
    rng = random.Random(4242)
    paths = [*GOOD, *ADMIN]
    started = time.monotonic()
    seen_before = len(rig.decode.seen)
    for i in range(NUM_RANDOM):
        if i % CHECK_EVERY == 0:
            check_serving(client, rig)
            seen_before = len(rig.decode.seen)
        path = rng.choice(paths)
        raw = bad_generation(rng, path) if path in GOOD else bad_admin(rng)
        headers = {"content-type": rng.choice(["application/json", "text/plain", "x/y"])}
        if path in ADMIN:
            headers |= AUTH
        check_error(
            client.post(rig.proxy.url + path, content=raw, headers=headers), f"{path} {raw[:80]!r}"
        )
        assert len(rig.decode.seen) == seen_before, f"{path} {raw[:80]!r} reached the engine"
    check_serving(client, rig)
    assert time.monotonic() - started < 60


def test_unknown_generation_fields_are_passed_to_the_engine(rig: Rig, client: httpx.Client) -> None:
    """The proxy checks what it relies on; other fields are the engine's (vLLM
    takes many sampling extensions) and reach it unchanged."""
    body = {**GOOD["/v1/completions"], "top_k": 3, "x_custom": {"a": [1]}}
    response = client.post(rig.proxy.url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert rig.decode.seen[-1]["body"]["x_custom"] == {"a": [1]}
