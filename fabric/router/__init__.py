"""The PD proxy: pairs each request with a prefiller and a decoder.

``create_app(topology)`` builds the FastAPI app; ``fabric proxy CONFIG``
serves it (an engine stand-in for tests: :mod:`fabric.testing.fake_engine`).
"""

from __future__ import annotations

from fabric.router.app import create_app

__all__ = ["create_app"]
