"""vLLM integration: ``FabricConnector`` (load with kv_connector_module_path).

``FabricConnector`` (and vLLM with it) is imported when first asked for:
vLLM looks it up with ``getattr(module, "FabricConnector")``
(``vllm/distributed/kv_transfer/kv_connector/factory.py:108-110``). The
rest of the package loads without vLLM: ``fabric up`` checks each engine's
connector settings with :mod:`fabric.integrations.vllm.config` before it
starts any (importing vLLM there took seconds and printed its logs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric.integrations.vllm.connector import FabricConnector

__all__ = ["FabricConnector"]


def __getattr__(name: str) -> Any:
    if name == "FabricConnector":
        from fabric.integrations.vllm.connector import FabricConnector

        return FabricConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
