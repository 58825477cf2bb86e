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

    header, p_row, d_row = text.splitlines()[1:4]
    assert header.split()[:7] == ["name", "role", "url", "healthy", "state", "restarts", "pid"]
    assert p_row.split()[:7] == ["prefill-0", "prefill", "http://a", "yes", "up", "0", "11"]
    assert d_row.split()[:7] == ["decode-0", "decode", "http://b", "no", "down", "3", "-"]
    assert "12/512 chunks" in p_row and "chunks" not in d_row  # stale numbers left out
    assert "restarts  1" in text and "attaches  2" in text  # the store's process and service


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
