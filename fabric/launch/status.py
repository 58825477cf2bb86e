"""``fabric status [--url URL]``: a running proxy's ``/fabric/status`` as a table.

The proxy URL is ``--url``, else the ``proxy_url`` in ``WORKDIR/run/up.json``
(written by ``fabric up``), else ``http://127.0.0.1:8000``. Tables are drawn
with rich when it is installed, as plain text otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
ENGINE_COLUMNS = ("name", "role", "url", "healthy", "outstanding", "store", "error")


def proxy_url(url: str | None, workdir: str | Path) -> str:
    """``url``, else the one ``fabric up`` recorded under ``workdir``, else the default."""
    if url:
        return url.rstrip("/")
    try:
        recorded = json.loads((Path(workdir) / "run" / "up.json").read_text())["proxy_url"]
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_URL
    return str(recorded).rstrip("/")


def fetch_status(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET ``URL/fabric/status``; raises ``httpx.HTTPError`` when it fails."""
    response = httpx.get(f"{url}/fabric/status", timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def tables(status: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` of the engines and of the proxy's counters."""
    engines = [
        [_store_cell(e.get(c)) if c == "store" else _cell(e.get(c)) for c in ENGINE_COLUMNS]
        for e in status.get("engines", [])
    ]
    policies = status.get("policies", {})
    proxy = [
        ["in_flight", _cell(status.get("in_flight"))],
        ["prefill_policy", _cell(policies.get("prefill"))],
        ["decode_policy", _cell(policies.get("decode"))],
        ["disaggregate_min_prompt_tokens", _cell(status.get("disaggregate_min_prompt_tokens"))],
        *([name, _cell(value)] for name, value in status.get("counters", {}).items()),
    ]
    out = [("engines", list(ENGINE_COLUMNS), engines)]
    shared = status.get("shared_store")
    if isinstance(shared, dict):
        rows = [["endpoint", _cell(shared.get("endpoint"))], ["store", _store_cell(shared)]]
        rows += [
            [key.removeprefix("service_"), _cell(value)]
            for key, value in shared.items()
            if key.startswith("service_")
        ]
        out.append(("shared store", ["key", "value"], rows))
    out.append(("proxy", ["key", "value"], proxy))
    return out


def render_plain(status: dict[str, Any]) -> str:
    """The tables as aligned plain text."""
    out = []
    for title, header, rows in tables(status):
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        out.append("\n".join(line.rstrip() for line in lines))
    return "\n\n".join(out)


def print_status(status: dict[str, Any], url: str) -> None:
    """Print the tables, with rich when installed."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"fabric proxy at {url}\n\n{render_plain(status)}")
        return
    console = Console()
    console.print(f"fabric proxy at {url}")
    for title, header, rows in tables(status):
        table = Table(title=title, title_justify="left")
        for column in header:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        console.print(table)


def main(url: str | None, workdir: str) -> int:
    """``fabric status``: 0, or 1 with a message when the proxy does not answer."""
    target = proxy_url(url, workdir)
    try:
        status = fetch_status(target)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"fabric status: no status from {target}: {exc}", file=sys.stderr)
        return 1
    print_status(status, target)
    return 0


def _store_cell(store: Any) -> str:
    """``12/512 chunks, 0 reserved, disk 40 (1.2 GiB)`` from an engine's store status."""
    if not isinstance(store, dict):
        return "-"
    if "error" in store:
        return f"unreachable: {store['error']}"
    used = store.get("filled", 0) + store.get("pinned", 0)
    text = f"{used}/{store.get('num_slots', '?')} chunks, {store.get('reserved', 0)} reserved"
    if "disk_files" in store:
        text += f", disk {store['disk_files']} ({store.get('disk_bytes', 0) / 2**30:.1f} GiB)"
    return text


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)
