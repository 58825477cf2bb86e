"""The PD proxy: pairs each request with a prefiller and a decoder.

``create_app(topology)`` builds the FastAPI app; ``fabric proxy CONFIG``
serves it; :mod:`fabric.router.fake_engine` is an engine stand-in for tests
and proxy benchmarks.
"""

from __future__ import annotations

from fabric.router.app import create_app

__all__ = ["create_app"]
