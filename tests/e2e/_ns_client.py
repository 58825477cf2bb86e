"""An HTTP client inside a simulated host (a network namespace, :mod:`tests.netns`).

The test process sits in the root namespace, which has no address on the
simulated hosts' bridge, so its requests are made by this module run as a
script in the client's namespace: it reads one JSON command per line on
stdin, runs each on a thread of its own (requests overlap: a partition can
start while one runs) and writes one JSON result per line on stdout::

    {"id": 3, "method": "POST", "url": ..., "json": {...}, "stream": true, "timeout": 60}
 -> {"id": 3, "status": 200, "body": "...", "events": [...], "ttft_s": 0.4,
     "elapsed_s": 1.2, "error": null}

A stream command with ``"notify_events": n`` also gets ``{"id": 3,
"progress": n}`` as soon as its ``n``-th event arrived, while it is open.

``events``: a stream's ``data:`` payloads, parsed (``[DONE]`` as the string);
``ttft_s``: until the first event (a stream) or the answer (otherwise);
``error``: the transport error that ended the call, if one did;
``ended_at``: when it ended, on ``time.monotonic()`` (one clock for every
process of the machine, whatever their namespace).
"""

from __future__ import annotations

import itertools
import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]


def _run(command: dict[str, Any], out: threading.Lock) -> None:
    import httpx

    started = time.monotonic()
    result: dict[str, Any] = {"id": command["id"], "status": None, "body": "", "events": []}
    result |= {"ttft_s": None, "error": None}
    try:
        with (
            httpx.Client(timeout=command.get("timeout", 60), trust_env=False) as client,
            client.stream(command["method"], command["url"], json=command.get("json")) as answer,
        ):
            result["status"] = answer.status_code
            if command.get("stream") and answer.status_code == 200:
                for line in answer.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if result["ttft_s"] is None:
                        result["ttft_s"] = time.monotonic() - started
                    data = line[6:]
                    result["events"].append(data if data == "[DONE]" else json.loads(data))
                    if len(result["events"]) == command.get("notify_events"):
                        with out:
                            print(
                                json.dumps(
                                    {"id": command["id"], "progress": len(result["events"])}
                                ),
                                flush=True,
                            )
            else:
                result["body"] = answer.read().decode(errors="replace")
                result["ttft_s"] = time.monotonic() - started
    except Exception as exc:  # NOTE: reported, not raised: the test decides
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["ended_at"] = (
        time.monotonic()
    )  # NOTE: CLOCK_MONOTONIC is the machine's, not the namespace's
    result["elapsed_s"] = result["ended_at"] - started
    with out:
        print(json.dumps(result), flush=True)


def main() -> None:
    out = threading.Lock()
    for line in sys.stdin:
        command = json.loads(line)
        threading.Thread(target=_run, args=(command, out), daemon=True).start()


class NsClient:
    """This module as a script inside ``hosts``' namespace ``name``; stop it with ``close``."""

    def __init__(self, hosts: Any, name: str) -> None:
        argv = hosts.command(name, [sys.executable, str(Path(__file__).resolve())])
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self._ids = itertools.count()
        self._results: dict[int, dict[str, Any]] = {}
        self._arrived: queue.Queue[dict[str, Any]] = queue.Queue()
        self._progress: dict[int, int] = {}  # NOTE: written by the reader thread only
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            if "progress" in message:
                self._progress[message["id"]] = message["progress"]
            else:
                self._arrived.put(message)

    def submit(
        self,
        url: str,
        payload: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        timeout: float = 300,
        notify_events: int | None = None,
    ) -> int:
        """Start a request; its id for :meth:`result` (and :meth:`progressed`,
        with ``notify_events``: a stream's events to count)."""
        ident = next(self._ids)
        stream = bool(payload and payload.get("stream"))
        command = {"id": ident, "method": method, "url": url, "json": payload}
        command |= {"stream": stream, "timeout": timeout, "notify_events": notify_events}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return ident

    def result(self, ident: int, timeout: float = 360) -> dict[str, Any]:
        """The result of request ``ident``, waiting up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while ident not in self._results:
            left = deadline - time.monotonic()
            assert left > 0, f"request {ident}: no result within {timeout} s"
            try:
                arrived = self._arrived.get(timeout=min(left, 1.0))
            except queue.Empty:
                assert self.process.poll() is None, "the namespace client exited"
                continue
            self._results[arrived["id"]] = arrived
        return self._results.pop(ident)

    def finished(self, ident: int) -> dict[str, Any] | None:
        """Request ``ident``'s result if it has ended (kept for :meth:`result`), else None."""
        while True:
            try:
                arrived = self._arrived.get_nowait()
            except queue.Empty:
                break
            self._results[arrived["id"]] = arrived
        return self._results.get(ident)

    def progressed(self, ident: int) -> int:
        """Events the client had read of stream ``ident`` when it last told
        (its ``notify_events``, once that many came; 0 before)."""
        return self._progress.get(ident, 0)

    def call(self, url: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        """A request, waited for."""
        method = kw.pop("method", "POST" if payload is not None else "GET")
        return self.result(self.submit(url, payload, method=method, **kw))

    def get_json(self, url: str) -> Any:
        """``GET url``'s JSON answer (asserting a 200)."""
        answer = self.call(url, timeout=30)
        assert answer["status"] == 200, answer
        return json.loads(answer["body"])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


if __name__ == "__main__":
    main()
