"""Benchmark implementations shared by ``benchmarks/*.py`` and ``fabric bench``."""
