"""The fake engine behind fabric's drain middleware, as ``vllm_main`` puts vLLM behind it.

Run: ``python tests/launch/drain_engine.py --port N ...`` (the fake engine's
options). SIGTERM drains it (``fabric.launch.drain.EngineDrain``, with the
drain file and timeout from the environment ``fabric up`` sets).
"""

from __future__ import annotations

import contextlib
import sys

import uvicorn

from fabric.launch.drain import EngineDrain
from fabric.testing.fake_engine import config_from_args, create_fake_engine, parse_args


def main() -> int:
    ns = parse_args(sys.argv[1:])
    app = EngineDrain(create_fake_engine(config_from_args(ns)))
    # NOTE: uvicorn re-raises the SIGINT the drain ends with, once it stopped.
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(app, host=ns.host, port=ns.port, access_log=False, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
