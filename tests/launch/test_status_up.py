"""``fabric status`` with what ``fabric up`` recorded: state, restarts, pid; no stale numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fabric.launch.status import read_up_state, render_plain, with_up_state

URL = "http://127.0.0.1:8000"


def status() -> dict[str, Any]:
    store = {"num_slots": 512, "filled": 12, "pinned": 0, "reserved": 0}
    return {
        "engines": [
            {"name": "prefill-0", "role": "prefill", "url": "http://a", "healthy": True,
             "outstanding": 0, "store": store, "error": None},
            {"name": "decode-0", "role": "decode", "url": "http://b", "healthy": False,
             "outstanding": 0, "store": store, "error": "process exited with signal SIGKILL"},
        ],
        "shared_store": {"endpoint": "tcp://127.0.0.1:9", "num_slots": 4, "service_attaches": 2},
        "counters": {},
    }  # fmt: skip


def up_state() -> dict[str, Any]:
    return {
        "proxy_url": URL + "/",
        "engines": [
            {"name": "prefill-0", "pid": 11, "state": "up", "restarts": 0},
            {"name": "decode-0", "pid": None, "state": "down", "restarts": 3},
        ],
        "store": {"pid": 10, "state": "up", "restarts": 1},
    }


def test_engines_show_their_supervised_state_and_a_down_one_no_store_numbers() -> None:
    text = render_plain(with_up_state(status(), up_state(), URL))

    header, p_row, p_detail, d_row, d_detail = text.splitlines()[1:6]
    assert header.split() == ["name", "role", "healthy", "state", "restarts", "pid", "busy"]
    assert p_row.split() == ["prefill-0", "prefill", "yes", "up", "0", "11", "0"]
    assert d_row.split() == ["decode-0", "decode", "no", "down", "3", "-", "0"]
    assert p_detail.split()[0] == "http://a" and "12/512 chunks" in p_detail
    assert d_detail.split()[0] == "http://b" and "chunks" not in d_detail  # stale: left out
    assert "error: process exited with signal SIGKILL" in d_detail
    assert "restarts  1" in text and "attaches  2" in text  # the store's process and service


def test_a_2p2d_status_fits_80_columns() -> None:
    """Every line of a busy 2P2D status (supervised, disk tiers, an error, every
    proxy counter) fits an 80-column terminal; long words wrap, none is cut."""
    store = {"num_slots": 65536, "filled": 40000, "pinned": 12, "reserved": 310,
             "disk_files": 123456, "disk_bytes": 17 * 2**30}  # fmt: skip
    error = "ConnectError: [Errno 111] Connection refused while probing /health " * 2
    engines = [
        {"name": f"{role}-{i}", "role": role, "url": f"http://10.77.0.{i + 2}:81{i}0",
         "healthy": i == 0, "outstanding": 31, "store": store, "error": None if i == 0 else error}
        for role in ("prefill", "decode") for i in range(2)
    ]  # fmt: skip
    counters = {f"prefill_fallbacks_unreachable_{i}": 10**6 for i in range(40)}
    status = {"engines": engines, "counters": counters, "in_flight": 64,
              "policies": {"prefill": "least_outstanding", "decode": "cache_aware"},
              "shared_store": {"endpoint": "tcp://10.77.0.9:7100", **store,
                               "service_attaches": 4, "service_fetches": 10**6}}  # fmt: skip
    supervised = {
        "proxy_url": URL,
        "engines": [{"name": e["name"], "pid": 123456, "state": "starting", "restarts": 12}
                    for e in engines],
        "store": {"pid": 99, "state": "up", "restarts": 0},
    }  # fmt: skip

    text = render_plain(with_up_state(status, supervised, URL), width=80)

    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert text.count("Connection refused") == 4  # wrapped, not cut
    assert "40012/65536 chunks, 310 reserved, disk 123456 (17.0 GiB)" in text.replace("\n    ", " ")


def test_a_record_of_another_proxy_is_not_merged() -> None:
    merged = with_up_state(status(), up_state(), "http://127.0.0.1:9999")
    assert "restarts" not in render_plain(merged).splitlines()[1]


def test_a_missing_or_broken_up_json_reads_as_nothing(tmp_path: Path) -> None:
    assert read_up_state(tmp_path) == {}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "up.json").write_text("{not json")
    assert read_up_state(tmp_path) == {}
    (tmp_path / "run" / "up.json").write_text(json.dumps(up_state()))
    assert read_up_state(tmp_path)["store"]["restarts"] == 1
