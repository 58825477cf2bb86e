"""Stand-ins for what fabric works with, for tests, demos and benchmarks.

- :mod:`fabric.testing.models`: tiny random-weight Llamas (and random LoRA
  adapters for them), built locally (``fabric model tiny DIR``; a topology's
  ``model: tiny``), so real vLLM engines run where no model hub can be
  reached. Greedy outputs are deterministic: a colocated engine's are the
  oracle for PD's.
- :mod:`fabric.testing.fake_engine`: an engine stand-in (vLLM's OpenAI
  routes, ``/health``, ``/metrics``, faults on request) with
  :mod:`fabric.testing.fake_kv`, a decoder's control port as far as the
  proxy uses it; ``python -m fabric.testing.fake_engine``.

Nothing in the product imports these except to build the tiny model.
"""
