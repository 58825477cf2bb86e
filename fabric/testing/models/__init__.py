"""Models fabric builds for itself: tiny random-weight Llamas and random LoRA
adapters for them, for offline tests."""

from __future__ import annotations

from fabric.testing.models.lora import make_tiny_lora
from fabric.testing.models.tiny import TinyModelSpec, make_tiny_model

__all__ = ["TinyModelSpec", "make_tiny_lora", "make_tiny_model"]
