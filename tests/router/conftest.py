"""Fixtures: fake engines and proxies started on free ports, stopped after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from fabric.testing.fake_engine import FakeEngineConfig

from .servers import FakeEngine, Proxy, ServerThread, topology

StartEngine = Callable[..., FakeEngine]
StartProxy = Callable[..., Proxy]


@pytest.fixture
def servers() -> Iterator[list[ServerThread]]:
    """Every server a test starts; all stopped at teardown."""
    started: list[ServerThread] = []
    yield started
    for server in started:
        server.request_stop()
    for server in started:
        server.stop()


@pytest.fixture
def start_engine(servers: list[ServerThread]) -> StartEngine:
    """Start a fake engine: ``start_engine("prefill", delay_s=1.0)`` (``gated=True``:
    behind an engine's drain gate)."""

    def start(role: str = "decode", *, gated: bool = False, **options: Any) -> FakeEngine:
        config = FakeEngineConfig(role=role, **options)  # type: ignore[arg-type]
        engine = FakeEngine(config, gated=gated).start()
        servers.append(engine)
        return engine

    return start


@pytest.fixture
def start_proxy(servers: list[ServerThread]) -> StartProxy:
    """Start a proxy over engine URLs: ``start_proxy([p.url], [d.url], decode_timeout_s=1)``."""

    def start(prefill_urls: list[str], decode_urls: list[str], **proxy: Any) -> Proxy:
        config, _ = topology(prefill_urls, decode_urls, **proxy)
        server = Proxy(config).start()
        servers.append(server)
        return server

    return start


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    """A plain HTTP client for the tests, bounded so nothing hangs."""
    with httpx.Client(timeout=20.0, trust_env=False) as c:
        yield c
