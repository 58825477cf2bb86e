"""Session-wide settings of the test suite."""

from __future__ import annotations

import os

from fabric.integrations.vllm.counters import STRICT_ENV

# NOTE: a name that is not a counter fails the test that adds it (and the
# engines the tests start inherit it); in production it is logged and dropped.
os.environ.setdefault(STRICT_ENV, "1")
