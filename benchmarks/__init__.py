"""fabric's benchmarks: runnable scripts (``python benchmarks/NAME.py``) and
what only they use (``nixl_proxy``, ``tap``, ``chaos``), importable as
``benchmarks.NAME`` from the repository root (the tests do). Not part of the
installed package: ``fabric bench transfer`` and ``fabric bench serve`` are
the user commands (:mod:`fabric.bench`)."""
