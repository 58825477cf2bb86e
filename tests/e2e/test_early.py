"""Early handoff on real vLLM: the decoder gets its request at dispatch.

Engines (tiny model), each computing at most 256 tokens per step (the
same numerics for a prompt, wherever it is computed): a colocated oracle; a
prefiller (so a long prompt's prefill spans many steps, and its
chunks are pushed while it still computes); a decoder. The proxy (in this
process) sends D each request at dispatch (``handoff: early``, the
default). Every answer must equal the colocated engine's, however the
prefill ends: done, P killed mid-prefill (D recomputes once the proxy
tells it), the client gone during the prefill (P and D drop it, D's
blocks are free again), or D out of early budget (the sequential flow).
The same through a prefiller with ``direct_reads`` (D READs each chunk out
of its KV cache; vLLM keeps its blocks until D read them): done, client
gone (P's held blocks are free again), P killed mid-read. And through one
with ``direct_reads: auto``, which measures both paths on its link to D
and then keeps the one cheaper on its threads: every answer equal.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fabric.launch.process import free_port
from fabric.transfer.store_client import StoreClient
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

pytestmark = pytest.mark.e2e

LONG = 3800  # tokens: 15 prefill steps of 256 on P
STEP_TOKENS = ["--max-num-batched-tokens", "256", "--max-num-seqs", "16"]


class Cluster:
    def __init__(self, engines: EngineFactory, model_dir: Path) -> None:
        self.kv_port = free_port()
        specs: dict[str, dict[str, Any]] = {
            # NOTE: the oracle chunks its prefill as P does: the same numerics
            "colocated": {"cpu_cores": "0", "extra_args": STEP_TOKENS},
            "prefill": {
                "cpu_cores": "0",
                "kv_transfer_config": kv_config("kv_producer"),
                "extra_args": STEP_TOKENS,
            },
            # NOTE: direct_reads: D reads each chunk out of this one's KV cache
            "direct": {
                "cpu_cores": "0",
                "kv_transfer_config": kv_config("kv_producer", direct_reads=True),
                "extra_args": STEP_TOKENS,
            },
            # NOTE: direct_reads auto: staged or direct per push, by measured cost
            "auto": {
                "cpu_cores": "0",
                "kv_transfer_config": kv_config("kv_producer", direct_reads="auto"),
                "extra_args": STEP_TOKENS,
            },
            "decode": {
                "cpu_cores": "1",
                "kv_transfer_config": kv_config("kv_consumer", kv_port=self.kv_port),
                "extra_args": STEP_TOKENS,  # NOTE: a prompt it recomputes: the same numerics
            },
        }
        self.engines: dict[str, Engine] = engines.start_many(model_dir, specs)
        self.proxies: list[Proxy] = []

    def proxy(self, prefill: str = "prefill", **settings: Any) -> Proxy:
        proxy = Proxy(
            [self.engines[prefill].base_url],
            [(self.engines["decode"].base_url, self.kv_port)],
            **settings,
        )
        self.proxies.append(proxy)
        return proxy

    def want(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        return complete(self.engines["colocated"].url("/v1/completions"), body(prompt))

    def d_stats(self) -> dict[str, int]:
        with StoreClient(f"tcp://127.0.0.1:{self.kv_port}", timeout_ms=10_000) as store:
            return store.stats()

    def d_log(self) -> str:
        return Path(self.engines["decode"].process.log_path).read_text(errors="replace")


@pytest.fixture(scope="module")
def cluster(engines: EngineFactory, tiny_model_dir: Path) -> Iterator[Cluster]:
    c = Cluster(engines, tiny_model_dir)
    yield c
    for proxy in c.proxies:
        proxy.stop()


def proxy_counter(proxy: Proxy, name: str) -> float:
    text = httpx.get(proxy.url("/metrics"), timeout=10).text
    match = re.search(rf"^fabric_proxy_{name}_total (\S+)$", text, re.M)
    assert match, f"fabric_proxy_{name}_total not in /metrics"
    return float(match.group(1))


def wait_idle(engine_url: str, timeout: float = 60.0) -> None:
    """Until the engine runs and waits for no request and holds no KV block."""
    deadline = time.monotonic() + timeout
    while True:
        busy = (
            metric(engine_url, "vllm:num_requests_running")
            + metric(engine_url, "vllm:num_requests_waiting")
            + metric(engine_url, "vllm:kv_cache_usage_perc")
        )
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"{engine_url} still busy: {busy}"
        time.sleep(0.2)


def heard(cluster: Cluster) -> int:
    """The proxy's words on prefills D's server took, kept or late."""
    stats = cluster.d_stats()
    return int(stats["server_prefill_notes"] + stats["server_prefill_notes_late"])


def test_early_admitted_requests_equal_colocated(cluster: Cluster) -> None:
    d_url, p_url = cluster.engines["decode"].base_url, cluster.engines["prefill"].base_url
    proxy = cluster.proxy()
    before_ok = metric(d_url, "vllm:fabric_loads_ok_total")
    before_layered = metric(p_url, "vllm:fabric_chunks_packed_layerwise_total")
    before_parts = metric(p_url, "vllm:fabric_parts_sent_total")
    before_streamed = metric(d_url, "vllm:fabric_chunks_streamed_total")
    words = heard(cluster)
    lengths = [300, 700, 1300, LONG]
    for i, n in enumerate(lengths):
        prompt = prompt_ids(n, seed=5000 + i)
        got = complete(proxy.url("/v1/completions"), body(prompt, stream=i % 2 == 1))
        assert_same(got, cluster.want(prompt))
    assert metric(d_url, "vllm:fabric_loads_ok_total") - before_ok == len(lengths)
    # NOTE: P packed every chunk (fresh prompts) a layer group at a time inside
    # its forward passes, driven by vLLM's own save_kv_layer calls
    chunks = sum(-(-n // 256) for n in lengths)
    assert metric(p_url, "vllm:fabric_chunks_packed_layerwise_total") - before_layered == chunks
    assert metric(d_url, "vllm:fabric_load_failures_total") == 0
    # NOTE: P wrote the groups it packed during its forwards at once (layer_writes),
    # and D unpacked some chunks a group at a time as they landed (a chunk whose
    # last write came before D's loader saw its first is verified whole)
    assert metric(p_url, "vllm:fabric_parts_sent_total") - before_parts >= chunks
    assert metric(d_url, "vllm:fabric_chunks_streamed_total") - before_streamed > 0
    assert metric(d_url, "vllm:fabric_streams_redone_total") == 0
    assert proxy_counter(proxy, "early_handoffs") == len(lengths)
    assert proxy_counter(proxy, "fallbacks") == 0
    # NOTE: D heard the proxy's word: running at dispatch, done after P answered
    # (a done that comes after D loaded everything and released the note is late)
    assert heard(cluster) - words >= 2 * len(lengths)


def _token_ids(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]


def _text(events: list[dict[str, Any]]) -> str:
    return "".join(c["text"] for e in events for c in e["choices"])


def _stream_events(url: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json=payload, timeout=300) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize(("n", "handoff"), [(700, "early"), (LONG, "early"), (LONG, "sequential")])
def test_the_prefillers_first_token_goes_first_and_the_stream_equals_colocated(
    cluster: Cluster, n: int, handoff: str
) -> None:
    """``first_token: prefiller``: the client's first token is P's (vLLM's
    answer to P's one-token request), the rest D's; tokens, text, usage and
    ids as the colocated engine streams them.

    NOTE: admitted early, D waits for the KV, not for P's answer, so on a
    busy machine its own token can reach the proxy first (then it goes
    first: a full run of the suite saw that for 3 of 4 requests, alone
    never); after a sequential handoff D starts after P answered, so P's
    token always goes first there."""
    sampling = {"temperature": 0}
    proxy = cluster.proxy(first_token="prefiller", handoff=handoff)
    prompt = prompt_ids(n, seed=5300 + n)
    payload = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **sampling,
    }
    oracle = cluster.engines["colocated"].url("/v1/completions")
    want = _stream_events(oracle, payload)
    got = _stream_events(proxy.url("/v1/completions"), payload)
    # NOTE: another prompt (this one is in P's and D's prefix caches now)
    other = {**payload, "prompt": prompt_ids(n, seed=5400 + n), "return_token_ids": False}
    hidden = _stream_events(proxy.url("/v1/completions"), other)
    hidden_want = _stream_events(oracle, other)

    assert len(_token_ids(want)) == 6
    assert _token_ids(got) == _token_ids(want) and _text(got) == _text(want)
    assert _text(hidden) == _text(hidden_want)
    assert got[-1]["usage"] == want[-1]["usage"] == hidden[-1]["usage"]
    assert [c["prompt_token_ids"] for c in got[0]["choices"]] == [prompt]
    for events in (got, hidden):
        assert len({e["id"] for e in events}) == len({e["created"] for e in events}) == 1
        assert events[0]["id"].startswith("cmpl-")
    assert all(c["token_ids"] is None for e in hidden for c in e["choices"])

    # NOTE: the same keys as vLLM's own events, in the first (P's), the
    # later (D's) and the last (usage) ones. Not as many events: vLLM merges
    # the tokens of a stream whose reader fell behind into one event
    # (vllm/v1/engine/output_processor.py:69-79, RequestOutputCollector.put;
    # a full run on a slow machine got D's five tokens in two events)
    def keys(events: list[dict[str, Any]]) -> tuple[object, ...]:
        choices = {tuple(sorted(c)) for e in events for c in e["choices"]}
        middle = {tuple(sorted(e)) for e in events[1:-1]}
        return sorted(events[0]), middle, sorted(events[-1]), choices

    assert keys(got) == keys(want)
    from_prefill = proxy_counter(proxy, "first_tokens_from_prefill")
    assert from_prefill + proxy_counter(proxy, "first_tokens_from_decode") == 2
    assert from_prefill == 2 or handoff == "early"
    assert proxy_counter(proxy, "first_token_mismatches") == 0
    assert proxy_counter(proxy, "fallbacks") == 0


def test_a_seeded_first_token_from_the_prefiller_equals_colocated(cluster: Cluster) -> None:
    """Seeded sampling: P's first token is the one D draws (the same seed, the
    same first draw), and D's later draws are a colocated engine's.

    NOTE: prompts of one prefill step: vLLM's CPU runner cannot rewind a
    seeded generator after a partial (chunked) prefill step (RuntimeError:
    CPU Generator does not use offset, vllm/v1/worker/gpu_model_runner.py:3502,
    on a colocated engine alike). A sequential handoff: D starts after P
    answered, so P's token goes first (admitted early, D's can win the race).
    """
    proxy = cluster.proxy(first_token="prefiller", handoff="sequential")
    oracle = cluster.engines["colocated"].url("/v1/completions")
    for sent in range(2):
        payload = {
            "model": "tiny",
            "prompt": prompt_ids(200, seed=5500 + sent),
            "max_tokens": 6,
            "ignore_eos": True,
            "temperature": 0.8,
            "seed": 3 + sent,
            "stream": True,
            "return_token_ids": True,
        }
        want = _stream_events(oracle, payload)
        got = _stream_events(proxy.url("/v1/completions"), payload)
        # NOTE: the tokens, not the events, are compared: vLLM merges a
        # lagging stream's tokens into one event (output_processor.py:69-79)
        assert _token_ids(got) == _token_ids(want)
        assert [len(c["token_ids"]) for c in got[0]["choices"]] == [1]  # P's own event
        assert len(got) >= 2  # NOTE: D's tokens streamed after it, not with it
        assert _text(got) == _text(want)
    assert proxy_counter(proxy, "first_tokens_from_prefill") == 2
    assert proxy_counter(proxy, "first_token_mismatches") == 0


def test_the_rest_after_the_prefillers_token_is_a_colocated_engines_rest(
    cluster: Cluster,
) -> None:
    """What the proxy asks a decoder whose first token was not P's
    (``first_token.continuation``: the prompt's ids plus P's token, one token
    less), sent to real vLLM, streams what the colocated engine streamed
    after that token: the same token ids, text that goes on where P's left
    it (no BOS added, the detokenizer primed with the whole prompt), and,
    with the proxy's usage shift, the same usage."""
    from fabric.router.first_token import FirstToken, Splice, continuation

    oracle = cluster.engines["colocated"].url("/v1/completions")
    for seed in range(5600, 5620):
        prompt = prompt_ids(300, seed=seed)
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        answer = {k: v for k, v in body.items() if k != "stream_options"}
        answer |= {"max_tokens": 1, "stream": False, "return_token_ids": True}
        one = httpx.post(oracle, json=answer, timeout=300)
        assert one.status_code == 200, one.text
        first = FirstToken.of(one.json(), 0.0)
        if first is not None and first.text:
            break
    else:
        pytest.skip("no prompt whose first token has a text")
    want = _stream_events(oracle, {**body, "return_token_ids": True})
    again = continuation(body, first)
    assert again is not None and again["prompt"] == [*prompt, first.token_id]
    splice = Splice(want_ids=True, after=first)
    raw = b"".join(
        b"data: " + json.dumps(e).encode() + b"\n\n" for e in _stream_events(oracle, again)
    )
    rest = [json.loads(e[6:]) for e in splice.feed(raw)]

    assert [first.token_id, *_token_ids(rest)] == _token_ids(want)
    assert first.text + _text(rest) == _text(want)
    assert rest[-1]["usage"] == want[-1]["usage"]


def test_a_decoder_out_of_early_budget_takes_the_sequential_flow(cluster: Cluster) -> None:
    d_url = cluster.engines["decode"].base_url
    proxy = cluster.proxy(early_max_tokens=1)
    before_ok = metric(d_url, "vllm:fabric_loads_ok_total")
    prompt = prompt_ids(900, seed=5100)
    assert_same(complete(proxy.url("/v1/completions"), body(prompt)), cluster.want(prompt))
    assert proxy_counter(proxy, "early_refused") == 1
    assert proxy_counter(proxy, "early_handoffs") == 0
    assert metric(d_url, "vllm:fabric_loads_ok_total") - before_ok == 1


def test_a_client_gone_during_the_prefill_frees_p_and_d(cluster: Cluster) -> None:
    proxy = cluster.proxy()
    _leave_mid_prefill(cluster, proxy, "prefill", "server_chunks_filled", seed=5200)
    assert proxy_counter(proxy, "client_disconnects") == 1


def _leave_mid_prefill(
    cluster: Cluster, proxy: Proxy, prefiller: str, landed: str, *, seed: int
) -> None:
    """Send a long prompt, leave once D's stat ``landed`` grew (some chunks
    landed: P is mid-prefill), then P and D must drop it and free everything."""
    payload = json.dumps(body(prompt_ids(LONG, seed=seed)) | {"max_tokens": 200}).encode()
    before = cluster.d_stats()[landed]
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
        client.sendall(head.encode() + payload)
        _wait_until(lambda: cluster.d_stats()[landed] > before)
    for name in (prefiller, "decode"):
        wait_idle(cluster.engines[name].base_url)
    assert cluster.d_stats()["reserved"] == 0
    _wait_until(lambda: _tables(proxy)["requests"] == 0 and _tables(proxy)["early_transfers"] == 0)


def _tables(proxy: Proxy) -> dict[str, int]:
    return dict(httpx.get(proxy.url("/fabric/status"), timeout=10).json()["tables"])


def test_direct_reads_equal_colocated_and_free_the_prefillers_blocks(cluster: Cluster) -> None:
    d_url, p_url = cluster.engines["decode"].base_url, cluster.engines["direct"].base_url
    proxy = cluster.proxy("direct")
    before_ok = metric(d_url, "vllm:fabric_loads_ok_total")
    before_offered = metric(p_url, "vllm:fabric_chunks_offered_total")
    before_held = metric(p_url, "vllm:fabric_holds_released_total")
    before_failed = metric(d_url, "vllm:fabric_load_failures_total")
    before_parts = metric(p_url, "vllm:fabric_parts_offered_total")
    before_streamed = metric(d_url, "vllm:fabric_chunks_streamed_total")
    read = cluster.d_stats()["server_chunks_read"]
    parts_read = cluster.d_stats()["server_parts_read"]
    before = cluster.d_stats()
    lengths = [300, 1300, LONG]
    for i, n in enumerate(lengths):
        prompt = prompt_ids(n, seed=5400 + i)
        got = complete(proxy.url("/v1/completions"), body(prompt, stream=i % 2 == 1))
        assert_same(got, cluster.want(prompt))
    chunks = sum(-(-n // 256) for n in lengths)
    assert metric(d_url, "vllm:fabric_loads_ok_total") - before_ok == len(lengths)
    assert metric(d_url, "vllm:fabric_load_failures_total") == before_failed
    assert cluster.d_stats()["server_chunks_read"] - read == chunks
    assert metric(p_url, "vllm:fabric_chunks_offered_total") - before_offered == chunks
    # NOTE: each chunk's leading layer groups were read during its step's forward
    parts = metric(p_url, "vllm:fabric_parts_offered_total") - before_parts
    assert parts >= chunks and cluster.d_stats()["server_parts_read"] - parts_read == parts
    # NOTE: a chunk is unpacked as its groups land only if D's loader saw a
    # group of it before its last offer verified; else the server's verifier
    # takes it whole (fabric/integrations/vllm/loader.py, ``_stream``): both
    # verified, which one depends on thread timing (a full run on a busy
    # machine had 22 of 23 chunks streamed)
    streamed = metric(d_url, "vllm:fabric_chunks_streamed_total") - before_streamed
    assert 0 < streamed <= chunks
    assert metric(p_url, "vllm:fabric_bytes_saved_total") == 0  # NOTE: nothing packed
    # NOTE: one host: D read P in place, almost all of it out of P's shared cache
    after = cluster.d_stats()
    gone = {k: after[k] - before[k] for k in after if k.startswith(("plane_", "server_bytes"))}
    assert gone["plane_local_bytes"] == gone["server_bytes_read"] > 0
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not (thp.exists() and "[always]" in thp.read_text()):  # NOTE: huge pages: not shared
        assert gone["plane_mapped_bytes"] >= 0.9 * gone["plane_local_bytes"]
    assert gone["plane_local_read_failures"] == 0
    # NOTE: vLLM kept each request's blocks until D read them, then freed them
    wait_idle(p_url)
    assert metric(p_url, "vllm:fabric_holds_released_total") - before_held == len(lengths)
    assert proxy_counter(proxy, "fallbacks") == 0


def test_direct_reads_auto_measures_both_paths_and_every_answer_is_right(
    cluster: Cluster,
) -> None:
    """The first push to a decoder is staged (its HelloAck says it reads),
    then the less measured path goes until each has two measured pushes,
    then the cheaper one on P's threads: every answer equals colocated's
    whichever path, all the KV came over the fabric, and vLLM freed every
    held block. (Counts are at least the requests': a readiness canary
    through the pair, should the proxy run one, is a push too.)"""
    d_url, p_url = cluster.engines["decode"].base_url, cluster.engines["auto"].base_url
    proxy = cluster.proxy("auto")
    before = {
        name: metric(url, f"vllm:fabric_{name}_total")
        for name, url in [
            ("pushes_direct", p_url),
            ("pushes_staged", p_url),
            ("holds_released", p_url),
            ("chunks_offered", p_url),
            ("loads_ok", d_url),
            ("load_failures", d_url),
        ]
    }
    lengths = [300, 700, 520, 1100, 300, 800]
    for i, n in enumerate(lengths):
        prompt = prompt_ids(n, seed=5700 + i)
        got = complete(proxy.url("/v1/completions"), body(prompt, stream=i % 2 == 0))
        assert_same(got, cluster.want(prompt))
    wait_idle(p_url)  # NOTE: vLLM freed every request's blocks, held or not

    def delta(name: str, url: str) -> float:
        return metric(url, f"vllm:fabric_{name}_total") - before[name]

    direct, staged = delta("pushes_direct", p_url), delta("pushes_staged", p_url)
    assert direct + staged >= len(lengths)
    assert direct >= 2 and staged >= 1, (direct, staged)  # NOTE: both measured on this link
    assert delta("holds_released", p_url) == direct + staged
    assert delta("chunks_offered", p_url) > 0
    assert delta("loads_ok", d_url) >= len(lengths) and delta("load_failures", d_url) == 0
    assert proxy_counter(proxy, "fallbacks") == 0


def test_a_client_gone_during_a_direct_prefill_frees_p_and_d(cluster: Cluster) -> None:
    """D read some chunks out of P's cache; P's held blocks are free again too."""
    proxy = cluster.proxy("direct")
    _leave_mid_prefill(cluster, proxy, "direct", "server_chunks_read", seed=5500)
    assert proxy_counter(proxy, "client_disconnects") == 1


def test_direct_p_killed_mid_prefill_d_recomputes(cluster: Cluster) -> None:
    """Kills the direct prefiller once D read some of the prompt's chunks out of it."""
    proxy = cluster.proxy("direct")
    _kill_mid_prefill(cluster, proxy, "direct", "server_chunks_read", seed=5600)
    assert proxy_counter(proxy, "fallbacks") == 1
    wait_idle(cluster.engines["decode"].base_url)
    assert cluster.d_stats()["reserved"] == 0


def test_p_killed_mid_prefill_d_recomputes_when_told(cluster: Cluster) -> None:
    """Runs last: it kills the prefiller once some of the prompt's chunks landed on D."""
    proxy = cluster.proxy()
    _kill_mid_prefill(cluster, proxy, "prefill", "server_chunks_filled", seed=5300)
    # NOTE: the load failed on the proxy's word, not on a bound running out
    log = cluster.d_log()
    assert re.search(r"the prefill of \S+ failed: prefill on p0: ", log), log[-3000:]
    assert proxy_counter(proxy, "fallbacks") == 1


def _kill_mid_prefill(
    cluster: Cluster, proxy: Proxy, prefiller: str, landed: str, *, seed: int
) -> None:
    """SIGKILL ``prefiller`` once D's stat ``landed`` grew during a long
    prompt's prefill; the answer must still equal the colocated engine's,
    and D must have failed the load (it recomputed).

    The kill must land mid-prefill: P's engine core and workers are stopped
    first (its API server runs on, so an answer already computed reaches the
    proxy meanwhile), and P is killed only if after 0.5 s the proxy still
    waits on the prefill leg (the ``early_transfers`` table) and D lacks
    some of the prompt's chunks (so it cannot load them all). Otherwise the
    prefill ended first (a slow poll on a busy machine): P goes on, its
    answer is checked, and another prompt is tried.
    """
    engine = cluster.engines[prefiller]
    d_url = cluster.engines["decode"].base_url
    failures = metric(d_url, "vllm:fabric_load_failures_total")
    for attempt in range(4):
        prompt = prompt_ids(LONG, seed=seed + attempt)
        want = cluster.want(prompt)
        before = cluster.d_stats()[landed]
        request, result = _send_until_landed(cluster, proxy, prompt, landed, before)
        core = [pid for pid in engine.process.group_pids() if pid != engine.process.pid]
        assert core, "the prefiller has no engine core process"
        killed = False
        try:
            _signal_all(core, signal.SIGSTOP)
            time.sleep(0.5)
            held = cluster.d_stats()[landed] - before
            if _tables(proxy)["early_transfers"] == 1 and held < LONG // CHUNK_TOKENS:
                killed_at = time.monotonic()
                engine.process.stop(timeout=0)  # SIGKILL mid-prefill
                killed = True
        finally:
            if not killed:
                _signal_all(core, signal.SIGCONT)
        request.join(120)
        assert result, "the request did not finish"
        assert_same(result[0], want)
        if killed:
            print(f"answer {time.monotonic() - killed_at:.1f} s after the kill")
            break
        print(f"attempt {attempt}: the prefill ended before P was stopped")
    else:
        pytest.fail("every prefill ended before the prefiller could be stopped")
    wait_idle(d_url)
    _wait_until(lambda: metric(d_url, "vllm:fabric_load_failures_total") - failures == 1)


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _send_until_landed(
    cluster: Cluster, proxy: Proxy, prompt: list[int], landed: str, before: int
) -> tuple[threading.Thread, list[tuple[list[int], list[float]]]]:
    """Send ``prompt`` in a thread; return once D's stat ``landed`` grew past ``before``."""
    result: list[tuple[list[int], list[float]]] = []
    request = threading.Thread(
        target=lambda: result.append(complete(proxy.url("/v1/completions"), body(prompt)))
    )
    request.start()
    _wait_until(lambda: cluster.d_stats()[landed] > before)
    return request, result


def _wait_until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)
