"""``fabric status [--url URL]``: a running proxy's ``/fabric/status`` as a table.

The proxy URL is ``--url``, else the ``proxy_url`` in ``WORKDIR/run/up.json``
(written by ``fabric up``), else ``http://127.0.0.1:8000``. The tables are
plain text fitted to the terminal's width (80 columns when it is unknown).

Engines: ``healthy`` and ``outstanding`` (``busy``: requests the proxy has
in flight to it) are the proxy's view; ``state``
(``starting``, ``up``, ``down``, ``draining``, ``stopped``), ``restarts``
and ``pid`` are shown when ``up.json`` describes the proxy asked (what
``fabric up``'s supervisor recorded). The ``store`` column is empty for an
engine that is not healthy: its last numbers would be stale.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
ENGINE_COLUMNS = ("name", "role", "url", "healthy", "outstanding", "store", "error")
SUPERVISED_KEYS = ("state", "restarts", "pid")  # columns after healthy, from up.json
DETAIL_COLUMNS = ("url", "store", "error")
"""The engine columns drawn on the line below its row; the others are in the row."""
HEADINGS = {"outstanding": "busy"}  # NOTE: a column's heading where it is not its name
DEFAULT_WIDTH = 80
MIN_WIDTH = 40


def proxy_url(url: str | None, workdir: str | Path) -> str:
    """``url``, else the one ``fabric up`` recorded under ``workdir``, else the default."""
    if url:
        return url.rstrip("/")
    recorded = read_up_state(workdir).get("proxy_url")
    return str(recorded).rstrip("/") if recorded else DEFAULT_URL


def read_up_state(workdir: str | Path) -> dict[str, Any]:
    """``WORKDIR/run/up.json``, or ``{}`` when there is none (or it cannot be read)."""
    try:
        state = json.loads((Path(workdir) / "run" / "up.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def with_up_state(status: dict[str, Any], up_state: dict[str, Any], url: str) -> dict[str, Any]:
    """``status`` whose engines (and shared store) carry what ``fabric up``
    recorded of them, when ``up_state`` describes the proxy at ``url``."""
    if str(up_state.get("proxy_url", "")).rstrip("/") != url:
        return status
    supervised = {e.get("name"): e for e in up_state.get("engines", []) if isinstance(e, dict)}
    engines = [
        e | {k: supervised[e.get("name")].get(k) for k in SUPERVISED_KEYS}
        if e.get("name") in supervised
        else e
        for e in status.get("engines", [])
    ]
    out = status | {"engines": engines}
    store, shared = up_state.get("store"), status.get("shared_store")
    if isinstance(store, dict) and isinstance(shared, dict):
        out["shared_store"] = shared | {f"process_{k}": store.get(k) for k in SUPERVISED_KEYS}
    return out


def fetch_status(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET ``URL/fabric/status``; raises ``httpx.HTTPError`` when it fails."""
    response = httpx.get(f"{url}/fabric/status", timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def tables(status: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` of the engines and of the proxy's counters."""
    columns = engine_columns(status)
    engines = [[_engine_cell(e, c) for c in columns] for e in status.get("engines", [])]
    policies = status.get("policies", {})
    proxy = [
        ["in_flight", _cell(status.get("in_flight"))],
        ["prefill_policy", _cell(policies.get("prefill"))],
        ["decode_policy", _cell(policies.get("decode"))],
        ["disaggregate_min_prompt_tokens", _cell(status.get("disaggregate_min_prompt_tokens"))],
        *([name, _cell(value)] for name, value in status.get("counters", {}).items()),
    ]
    out = [("engines", columns, engines)]
    shared = status.get("shared_store")
    if isinstance(shared, dict):
        rows = [["endpoint", _cell(shared.get("endpoint"))], ["store", _store_cell(shared)]]
        rows += [
            [key.removeprefix("service_").removeprefix("process_"), _cell(value)]
            for key, value in shared.items()
            if key.startswith(("service_", "process_"))
        ]
        out.append(("shared store", ["key", "value"], rows))
    out.append(("proxy", ["key", "value"], proxy))
    return out


def engine_columns(status: dict[str, Any]) -> list[str]:
    """The engine table's columns: ``state``, ``restarts``, ``pid`` too when
    ``fabric up``'s record of them was merged in (:func:`with_up_state`)."""
    columns = list(ENGINE_COLUMNS)
    if any("restarts" in e for e in status.get("engines", [])):
        at = columns.index("healthy") + 1
        columns[at:at] = SUPERVISED_KEYS
    return columns


def render_plain(status: dict[str, Any], width: int = DEFAULT_WIDTH) -> str:
    """The tables as plain text no wider than ``width`` columns (when names allow).

    Engines: one row of the short columns each (those of ``fabric up``'s
    record included), then an indented line with its URL, store and error
    (:data:`DETAIL_COLUMNS`), wrapped at ``width``. Key/value tables (the shared
    store, the proxy's counters) are laid out in as many pairs per line as fit.
    """
    parts = []
    for title, header, rows in tables(status):
        if title == "engines":
            parts.append(_engine_lines(header, rows, width))
        else:
            parts.append("\n".join([title, *_pairs(rows, width)]))
    return "\n\n".join(parts)


def print_status(status: dict[str, Any], url: str) -> None:
    """Print the tables, fitted to the terminal's width."""
    width = max(shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns, MIN_WIDTH)
    print(f"fabric proxy at {url}\n\n{render_plain(status, width)}")


def _engine_lines(header: list[str], rows: list[list[str]], width: int) -> str:
    short = [i for i, column in enumerate(header) if column not in DETAIL_COLUMNS]
    shown = [[row[i] for i in short] for row in [header, *rows]]
    shown[0] = [HEADINGS.get(h, h) for h in shown[0]]
    widths = [max(len(r[i]) for r in shown) for i in range(len(short))]
    lines = ["engines"]
    for n, cells in enumerate(shown):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if n == 0:
            continue
        row = dict(zip(header, rows[n - 1], strict=True))
        detail = [row["url"]] + ([f"store {row['store']}"] if row["store"] != "-" else [])
        if row["error"] != "-":
            detail.append(f"error: {row['error']}")
        lines += textwrap.wrap(
            "  ".join(detail),
            width,
            initial_indent="  ",
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def _pairs(rows: list[list[str]], width: int) -> list[str]:
    """``key  value`` pairs, as many side by side as fit ``width``, column-major."""
    if not rows:
        return []
    key_w = max(len(k) for k, _ in rows)
    value_w = max(len(v) for _, v in rows)
    cell = key_w + 2 + value_w
    per_line = max(1, (width + 3) // (cell + 3))
    height = -(-len(rows) // per_line)
    lines = []
    for r in range(height):
        cells = [rows[i] for i in range(r, len(rows), height)]
        text = "   ".join(f"{k.ljust(key_w)}  {v.ljust(value_w)}" for k, v in cells)
        lines.append(text.rstrip())
    return lines


def main(url: str | None, workdir: str) -> int:
    """``fabric status``: 0, or 1 with a message when the proxy does not answer."""
    target = proxy_url(url, workdir)
    try:
        status = fetch_status(target)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"fabric status: no status from {target}: {exc}", file=sys.stderr)
        return 1
    print_status(with_up_state(status, read_up_state(workdir), target), target)
    return 0


def _engine_cell(engine: dict[str, Any], column: str) -> str:
    if column == "store":
        # NOTE: a down engine's numbers would be its last ones: stale.
        return _store_cell(engine.get("store")) if engine.get("healthy", True) else "-"
    return _cell(engine.get(column))


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
