"""An engine whose leader leaves a process behind when it is killed alone, as
vLLM's API server leaves its EngineCore and workers (they have no
parent-death check) -- the leftover keeps the engine's kv_port bound.

Run: ``python tests/launch/holder_engine.py KV_PORT PID_FILE ENGINE_ARGV...``.
It starts a holder (same process group) that listens on 127.0.0.1:KV_PORT
and sleeps, appends the holder's pid to PID_FILE, then becomes ENGINE_ARGV
(exec: the leader keeps its pid). When the holder cannot bind -- the port
is still held by the holder of an earlier leader -- it exits 3 at once,
like a restarted vLLM engine whose connector cannot bind its kv_port.
"""

from __future__ import annotations

import os
import subprocess
import sys

HOLD = (
    "import socket, sys, time\n"
    "sock = socket.socket()\n"
    "try:\n"
    "    sock.bind(('127.0.0.1', int(sys.argv[1])))\n"
    "except OSError as exc:\n"
    "    sys.exit(f'holder: cannot bind kv_port {sys.argv[1]}: {exc}')\n"
    "sock.listen()\n"
    "print('bound', flush=True)\n"
    "time.sleep(300)\n"
)


def main(argv: list[str]) -> int:
    kv_port, pid_file, engine = argv[0], argv[1], argv[2:]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, kv_port], stdout=subprocess.PIPE)
    assert holder.stdout is not None
    if holder.stdout.readline() != b"bound\n":
        print(f"holder_engine: kv_port {kv_port} is taken; exiting", flush=True)
        return 3
    with open(pid_file, "a") as pids:
        pids.write(f"{holder.pid}\n")
    print(f"holder_engine: holder pid {holder.pid} holds kv_port {kv_port}", flush=True)
    os.execv(engine[0], engine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
