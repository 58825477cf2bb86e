"""``scripts/layers.py``: the package's imports go one way, without cycles."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).parents[1]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layers", ROOT / "scripts" / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["layers"] = module
    spec.loader.exec_module(module)
    return module


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "fabric"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_fabric_has_no_cycle_and_no_upward_import() -> None:
    assert load().check(ROOT / "fabric") == []


def test_an_upward_and_a_sideways_import_are_found(tmp_path: Path) -> None:
    root = package(
        tmp_path,
        {
            "store/__init__.py": "",
            "store/service.py": "from fabric.transfer import client\n",
            "transfer/__init__.py": "",
            "transfer/client.py": "import fabric.store\n",
            "router/__init__.py": "",
            "router/app.py": "def f():\n    from fabric.integrations import vllm\n",
            "integrations/__init__.py": "",
            "integrations/vllm.py": "",
        },
    )
    findings = load().check(root)
    assert findings == [
        f"{root / 'router/app.py'}:2: sideways import of fabric.integrations.vllm",
        f"{root / 'store/service.py'}:1: upward import of fabric.transfer.client",
    ]


def test_a_cycle_is_found_also_through_a_lazy_import_but_not_a_typing_one(
    tmp_path: Path,
) -> None:
    root = package(
        tmp_path,
        {
            "kv/__init__.py": "",
            "kv/pack.py": "from fabric.kv.cuda import kernels_for\n",
            "kv/cuda.py": "def f():\n    from fabric.kv import pack\n",
            "kv/layout.py": "from fabric.kv.keys import chunk_keys\n",
            "kv/keys.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from fabric.kv.layout import KVLayout\n"
            ),
        },
    )
    assert load().check(root) == ["import cycle: fabric.kv.cuda -> fabric.kv.pack"]


def test_an_import_under_if_not_type_checking_runs_and_makes_a_cycle(tmp_path: Path) -> None:
    root = package(
        tmp_path,
        {
            "kv/__init__.py": "",
            "kv/layout.py": "from fabric.kv.keys import chunk_keys\n",
            "kv/keys.py": (
                "from typing import TYPE_CHECKING\nif not TYPE_CHECKING:\n"
                "    from fabric.kv.layout import KVLayout\n"
            ),
        },
    )
    assert load().check(root) == ["import cycle: fabric.kv.keys -> fabric.kv.layout"]
