"""fabric's threads carry their names to the OS (top -H, /proc/<pid>/task/<tid>/comm)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from fabric.threads import os_name, thread
from tests.transfer.test_loopback import make_node

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def os_names() -> set[str]:
    """The OS names of every thread of this process."""
    names = set()
    for tid in os.listdir("/proc/self/task"):
        name = os_name(int(tid))
        if name is not None:
            names.add(name)
    return names


def test_a_thread_names_itself_for_the_os_before_its_target_runs() -> None:
    seen: list[str | None] = []
    t = thread(lambda: seen.append(os_name()), name="fabric-a-long-thread-name")
    t.start()
    t.join(5)
    assert seen == ["fabric-a-long-t"]  # NOTE: the kernel keeps 15 bytes
    assert t.name == "fabric-a-long-thread-name" and t.daemon
    assert os_name(threading.get_native_id()) != "fabric-a-long-t"  # the caller is unchanged


def test_a_transfer_servers_threads_are_named() -> None:
    """Each names itself as it starts running: looked for until it has."""
    want = {"fabric-server", "fabric-verify", "foffload-0", "foffload-1", "fadmin-0"}
    node = make_node(4, serve=True)
    try:
        deadline = time.monotonic() + 10
        while not want <= os_names() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert want <= os_names()
    finally:
        node.close()
