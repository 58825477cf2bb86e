"""The deployment's secret when ``fabric up`` runs a single-host topology whose
proxy listens beyond loopback and the operator gave none.

The secret signs every engine's control channel and the shared store's,
and is the bearer token of the proxy's admin routes
(:mod:`fabric.router.admin`). With ``connector.secret_env`` the operator's
is used. Without it, and with the proxy reachable from other hosts,
``fabric up`` takes ``$FABRIC_SECRET`` if set, else generates one for this
run, hands it to every process it starts (in that variable), and writes it
to ``WORKDIR/run/secret`` (mode 0600) for the operator's admin calls. A
topology across hosts needs the operator's (every host must hold the same
one): :class:`~fabric.config.TopologyConfig` refuses one without.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

from fabric.config import TopologyConfig
from fabric.transfer.addresses import is_loopback

SECRET_ENV = "FABRIC_SECRET"


def needs_secret(topology: TopologyConfig) -> bool:
    """Whether ``fabric up`` must supply a secret the topology does not name."""
    connector, proxy = topology.connector, topology.proxy
    named = connector.secret_env is not None or proxy.admin_token_env is not None
    return not (named or connector.insecure or is_loopback(topology.proxy_bind))


def secret_path(topology: TopologyConfig) -> Path:
    """Where a generated secret is written for the operator."""
    return topology.workdir_path / "run" / "secret"


def with_secret(topology: TopologyConfig, announce: Callable[[str], None]) -> TopologyConfig:
    """``topology``, or where :func:`needs_secret`, a copy whose connector reads
    ``$FABRIC_SECRET``, which this process then holds (taken or generated)."""
    if not needs_secret(topology):
        return topology
    if os.environ.get(SECRET_ENV):
        announce(f"fabric up: the secret is ${SECRET_ENV} (the proxy listens beyond loopback)")
    else:
        os.environ[SECRET_ENV] = secrets.token_hex(32)
        path = secret_path(topology)
        write_private(path, os.environ[SECRET_ENV] + "\n")
        announce(
            f"fabric up: the proxy listens beyond loopback: generated a secret for this run "
            f"in {path} (it signs the engines' control channels and is the admin routes' "
            "bearer token)"
        )
    connector = topology.connector.model_copy(update={"secret_env": SECRET_ENV})
    return topology.model_copy(update={"connector": connector})


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only: a new file (mode
    0600, never through a symlink) in a directory made 0700, renamed over any
    file already there (whose mode and owner would otherwise stay)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
