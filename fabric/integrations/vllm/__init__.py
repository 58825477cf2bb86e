"""vLLM integration: ``FabricConnector`` (load with kv_connector_module_path).

Importing this package imports vLLM.
"""

from __future__ import annotations

from fabric.integrations.vllm.connector import FabricConnector

__all__ = ["FabricConnector"]
