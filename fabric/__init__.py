"""fabric: disaggregated prefill/decode KV transfer for vLLM over NIXL/UCX.

Heavy dependencies (torch, nixl, vllm) are imported lazily by the modules that
need them, so ``import fabric`` stays light.
"""

from __future__ import annotations

__version__ = "0.1.0"
