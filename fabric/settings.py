"""The one way fabric's configuration types are written and validated.

Every configuration type (the topology's sections, the connector's
``kv_connector_extra_config``, a transfer side's, a chunk store's, the
shared store's, fault injection's) is a :class:`Settings`: a frozen
pydantic model that refuses unknown keys. Built directly, any problem is a
:class:`~fabric.errors.ConfigError` whose message names the field the way a
user wrote it, one line per problem::

    TransferConfig(port=70000)
    # ConfigError: transfer.port: Input should be less than or equal to 65535

``SECTION`` is the name a type's fields are known by (``transfer``,
``faults``, ``kv_connector_extra_config``; empty: the bare field name). A
check across fields raises ``ValueError`` whose message starts with the
field it blames (``"lease_ms: ..."``); a helper that names its field in
full (``"transfer.host: ..."``) keeps its message. A topology file is
validated whole instead (:func:`fabric.config.load_topology`: the file's
name, then the field's path, inside :func:`validating_whole`), with the
same :func:`field_path`; ``model_validate`` outside :func:`validating_whole`
wraps the ``ConfigError`` in a ``ValidationError``, so call it inside. A
type inside another (``faults`` inside a transfer's settings) leaves its
errors to the outer one, which names the whole path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from fabric.errors import ConfigError

_WHOLE: ContextVar[bool] = ContextVar("fabric_settings_whole", default=False)
"""True while a :class:`Settings` is being validated: the types inside it
(pydantic calls their ``__init__`` too) leave their errors to it."""


class Settings(BaseModel):
    """Base of every configuration type (see the module docstring)."""

    # NOTE: pydantic's errors quote the input (a dict of every value given,
    # secrets included): the chained error would put them in a traceback
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    SECTION: ClassVar[str] = ""

    def __init__(self, **values: Any) -> None:
        if _WHOLE.get():  # NOTE: inside another: its errors carry this one's path
            super().__init__(**values)
            return
        with validating_whole():
            try:
                super().__init__(**values)
            except ValidationError as exc:
                raise ConfigError(describe(exc, type(self))) from exc


@contextmanager
def validating_whole() -> Iterator[None]:
    """Within it, building a :class:`Settings` raises pydantic's
    ``ValidationError`` (for a caller that names the source itself)."""
    token = _WHOLE.set(True)
    try:
        yield
    finally:
        _WHOLE.reset(token)


def describe(exc: ValidationError, settings: type[Settings]) -> str:
    """``SECTION.FIELD: message``, one line per error of ``exc`` (raised by
    validating ``settings``)."""
    section = settings.SECTION
    prefix = f"{section}." if section else ""
    known = sorted(settings.model_fields)
    lines = []
    for err in exc.errors(include_url=False):
        msg = str(err["msg"]).removeprefix("Value error, ")
        where = field_path(err["loc"])
        named = msg.split(":", 1)[0] if ":" in msg else ""
        if err["type"] == "extra_forbidden":
            lines.append(_unknown_key(settings, err["loc"]))
        elif prefix and named.startswith(prefix):
            lines.append(msg)  # NOTE: a helper named the field in full
        elif where and (named == where or named.startswith(f"{where}.")):
            lines.append(prefix + msg)  # a nested type's own message names it
        elif where:
            lines.append(f"{prefix}{where}: {msg}")
        elif named.split(".", 1)[0] in known:
            lines.append(prefix + msg)
        else:
            lines.append(f"{section}: {msg}" if section else msg)
    return "\n".join(lines)


def _unknown_key(settings: type[Settings], loc: tuple[int | str, ...]) -> str:
    """``SECTION.PARENT: unknown key 'KEY'; known: [...]``: the keys known to
    the type the key was given to."""
    owner = settings
    for part in loc[:-1]:
        field = owner.model_fields.get(part) if isinstance(part, str) else None
        kind = field.annotation if field is not None else None
        if not (isinstance(kind, type) and issubclass(kind, Settings)):
            return f"{settings.SECTION or 'settings'}: unknown key {field_path(loc)!r}"
        owner = kind
    where = ".".join(p for p in (settings.SECTION, field_path(loc[:-1])) if p)
    said = f"unknown key {loc[-1]!r}; known: {sorted(owner.model_fields)}"
    return f"{where}: {said}" if where else said


def field_path(loc: tuple[int | str, ...]) -> str:
    """``("decode", 0, "port")`` -> ``decode[0].port``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
