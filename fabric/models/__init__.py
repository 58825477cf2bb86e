"""Models fabric builds for itself: tiny random-weight Llamas for offline tests."""

from __future__ import annotations

from fabric.models.tiny import TinyModelSpec, make_tiny_model

__all__ = ["TinyModelSpec", "make_tiny_model"]
