"""Who may call the proxy's admin routes (``POST /fabric/lookup|clear|pin``).

They read what every engine's store holds and can empty or pin it, so they
take ``Authorization: Bearer <token>``. The token is the value of
``proxy.admin_token_env`` when set, else the connector's shared secret
(``connector.secret_env``). With neither, the routes are open, which only a
proxy bound to loopback may be (only this host's processes reach it):
beyond loopback the proxy refuses to start unless ``connector.insecure`` is
true. The read-only routes (``/health``, ``/metrics``, ``/fabric/status``,
``/v1/models``) and generation stay open: the engines' own API keys, if any,
guard generation (the client's ``Authorization`` is passed through).
"""

from __future__ import annotations

import hmac
import logging
import os

from fabric.config import TopologyConfig
from fabric.errors import ConfigError
from fabric.transfer.addresses import is_loopback

logger = logging.getLogger(__name__)


def admin_token(topology: TopologyConfig) -> str | None:
    """The admin routes' bearer token (None: open); ConfigError when a named
    environment variable is not set."""
    name = topology.proxy.admin_token_env
    if name is not None:
        value = os.environ.get(name, "").strip()  # NOTE: a file's trailing newline
        if not value:
            raise ConfigError(f"proxy.admin_token_env: environment variable {name!r} is not set")
        if any(c.isspace() for c in value):
            raise ConfigError(
                f"proxy.admin_token_env: ${name} holds whitespace, which no HTTP header can carry"
            )
        return value
    secret = topology.connector.secret()
    return None if secret is None else secret.strip()


def check_admin_exposure(topology: TopologyConfig, host: str) -> None:
    """Refuse a proxy bound to ``host`` beyond loopback whose admin routes
    would be open, unless ``connector.insecure`` (then log it loudly)."""
    if is_loopback(host) or admin_token(topology) is not None:
        return
    if not topology.connector.insecure:
        raise ConfigError(
            f"proxy.host: {host!r} is reachable from other hosts and its admin routes "
            "(/fabric/lookup, /fabric/clear, /fabric/pin) have no token: set "
            "connector.secret_env or proxy.admin_token_env (make one with: python -c "
            "'import secrets; print(secrets.token_hex(32))'), or connector.insecure: true"
        )
    logger.warning(
        "fabric proxy: serves %r with OPEN admin routes (insecure): any host that reaches "
        "it can clear or pin every engine's store",
        host,
    )


def authorized(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header value carries ``token`` (always,
    when there is no token). Compared in constant time."""
    if token is None:
        return True
    if header is None:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
