"""One validation style: every configuration type is a ``fabric.settings.Settings``."""

from __future__ import annotations

import ast
import importlib
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

import fabric
from fabric.config import parse_topology
from fabric.errors import ConfigError
from fabric.integrations.vllm.config import ConnectorConfig
from fabric.settings import Settings, validating_whole
from fabric.store import StoreConfig
from fabric.transfer import FaultConfig, TransferConfig

PACKAGE = Path(fabric.__file__).parent
SETTINGS_NAMES = ("Config", "Options")
"""A class whose name ends so is configuration; so is ``RestartPolicy`` (a restart backoff)."""


def configuration_classes() -> list[tuple[str, str]]:
    """(module, class) of every class in ``fabric/`` named like configuration."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and (
                node.name.endswith(SETTINGS_NAMES) or node.name == "RestartPolicy"
            ):
                found.append((module.removesuffix(".__init__"), node.name))
    return found


def test_every_configuration_type_is_settings() -> None:
    classes = configuration_classes()
    assert len(classes) >= 20  # NOTE: the walk finds them (it would pass on none)
    loose = []
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        if not issubclass(cls, Settings):
            loose.append(f"{module}.{name}")
    assert not loose, f"not Settings: {loose}"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TransferConfig(port=70000), r"^transfer\.port: Input should be less"),
        (lambda: TransferConfig(lease_ms=0), r"^transfer\.lease_ms: "),
        (lambda: TransferConfig(faults={"refuse": 2}), r"^transfer\.faults\.refuse: 2 is not in"),
        (lambda: FaultConfig(delay=True), r"^faults\.delay: Input should be a valid number"),
        (lambda: StoreConfig(slot_bytes=0, num_slots=1), r"^slot_bytes: "),
        (lambda: TransferConfig(host="0.0.0.0"), r"^transfer\.host: .*no secret"),
        (
            lambda: TransferConfig(poll_interval_ms=2.0, quiet_poll_interval_ms=1.0),
            r"^transfer\.quiet_poll_interval_ms: 1\.0 is below",
        ),
    ],
)
def test_a_bad_value_is_a_config_error_naming_section_and_field(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_an_unknown_key_names_the_type_it_was_given_to_and_its_keys() -> None:
    with pytest.raises(ConfigError) as caught:
        ConnectorConfig(faults={"corupt": 1.0})
    text = str(caught.value)
    assert text.startswith("kv_connector_extra_config.faults: unknown key 'corupt'; known: [")
    assert "'corrupt'" in text and "'chunk_tokens'" not in text
    with pytest.raises(ConfigError, match=r"^transfer: unknown key 'prot'; known: \[.*'port'"):
        TransferConfig(prot=1)


def test_every_problem_is_reported_once_each() -> None:
    with pytest.raises(ConfigError) as caught:
        TransferConfig(port=-1, lease_ms=0, faults={"corrupt": 5})
    lines = str(caught.value).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "transfer.port",
        "transfer.lease_ms",
        "transfer.faults.corrupt",
    ]


def test_settings_are_frozen() -> None:
    config = TransferConfig()
    with pytest.raises(ValidationError):
        config.port = 1  # type: ignore[misc]
    assert "secret" not in repr(TransferConfig(secret="s3cret")) and "s3cret" not in repr(
        TransferConfig(secret="s3cret")
    )


def test_a_topology_names_its_file_and_the_whole_path() -> None:
    with pytest.raises(ConfigError, match=r"^t\.yaml: connector\.reuse: Input should be"):
        parse_topology(
            {"prefill": [{"url": "http://a:1"}], "decode": [{"url": "http://b:2", "kv_port": 3}],
             "connector": {"reuse": "sometimes"}},
            "t.yaml",
        )  # fmt: skip


def test_within_validating_whole_the_pydantic_error_comes_through() -> None:
    with validating_whole(), pytest.raises(ValidationError):
        TransferConfig(port=-1)
    with pytest.raises(ConfigError):  # and only within it
        TransferConfig(port=-1)


SECRET = "-".join(("hunter2", "s3cret"))


@pytest.mark.parametrize(
    "build",
    [
        lambda: ConnectorConfig(lookup_timeout_ms=5, lookup_deadline_ms=1, secret=SECRET),
        lambda: TransferConfig(port=-1, secret=SECRET),
    ],
)
def test_a_secret_never_reaches_the_error_or_its_traceback(build: Callable[[], object]) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    shown = "".join(traceback.format_exception(caught.value))
    assert SECRET not in shown  # NOTE: the source lines shown name it SECRET
    assert "lookup_deadline_ms: 1 is below" in shown or "transfer.port: Input" in shown


def test_faults_null_is_the_default() -> None:
    assert ConnectorConfig(faults=None).faults == FaultConfig()
