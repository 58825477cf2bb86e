"""The ``fabric`` command line (its help, :data:`DESCRIPTION`, is plain text)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path


DESCRIPTION = """\
fabric: disaggregated prefill/decode for vLLM. Start a topology with
fabric up CONFIG, send OpenAI requests to its proxy, watch it with fabric
status; fabric COMMAND --help says more.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "version":
        from fabric import __version__

        print(__version__)
    elif ns.command == "bench":
        return _bench(ns.what, ns.rest)
    elif ns.command == "model":
        if ns.kind == "lora" and not ns.model:
            parser.error("fabric model lora: --model MODEL_DIR is required")
        print(_model(ns))
    elif ns.command == "status":
        from fabric.launch.status import main as status_main

        return status_main(ns.url, ns.workdir)
    elif ns.command in ("up", "proxy"):
        return _serve(ns)
    elif ns.command == "store":
        return _store(ns)
    elif ns.command == "k8s":
        return _k8s(ns)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fabric`` argument parser, every subcommand included."""
    parser = argparse.ArgumentParser(
        prog="fabric", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the fabric version")
    bench = sub.add_parser(
        "bench", help="benchmarks (fabric bench transfer --help, fabric bench serve --help)"
    )
    bench.add_argument("what", choices=["transfer", "serve"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    model = sub.add_parser(
        "model",
        help="build a test model (fabric model tiny DIR) or a random LoRA adapter for it "
        "(fabric model lora DIR --model MODEL_DIR)",
    )
    model.add_argument("kind", choices=["tiny", "lora"])
    model.add_argument("dir", help="output directory (a tiny model there is reused)")
    model.add_argument("--kv-heavy", action="store_true", help="tiny: Llama-3-8B KV geometry")
    model.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    model.add_argument("--model", help="lora: the tiny model directory the adapter is for")
    model.add_argument("--rank", type=int, default=8, help="lora: adapter rank (default 8)")
    _up_parser(sub)
    proxy = sub.add_parser("proxy", help="serve only the PD proxy for running engines")
    proxy.add_argument("config", help="topology YAML whose engines have url (or port)")
    proxy.add_argument("--host", help="listen address (default: proxy.host)")
    proxy.add_argument("--port", type=int, help="listen port (default: proxy.port)")
    _store_parser(sub)
    _k8s_parser(sub)
    status = sub.add_parser("status", help="a running proxy's engines and counters")
    status.add_argument("--url", help="proxy URL (default: WORKDIR/run/up.json, else :8000)")
    status.add_argument("--workdir", default="work", help="fabric up's workdir (default: work)")
    return parser


def _model(ns: argparse.Namespace) -> Path:
    """``fabric model tiny|lora``: the directory written."""
    if ns.kind == "lora":
        from fabric.testing.models import make_tiny_lora

        return make_tiny_lora(ns.dir, ns.model, rank=ns.rank, seed=ns.seed)
    from fabric.testing.models import make_tiny_model

    return make_tiny_model(ns.dir, kv_heavy=ns.kv_heavy, seed=ns.seed)


UP_DESCRIPTION = """\
Start a topology's engines (and its shared store), serve the PD proxy, and
keep them running until SIGTERM or SIGINT (Ctrl-C).

Supervision: an engine or the store that exits is marked down in the proxy at
once, what is left of its process group is killed, and it is restarted on
the same ports and args, after a backoff that starts at --restart-backoff-s
and doubles up to --restart-backoff-max-s (back to the start once it stayed
up 60 s). WORKDIR/run/up.json is rewritten on every change: each engine's
pid, state (starting/up/down/draining/stopped), restarts, last exit,
last_restart_to_serving_s (from the exit), last_restart_boot_s (the part
of it the program's own start took) and first_start_s.

SIGTERM/SIGINT/SIGHUP drains: new requests get 503 JSON, requests in flight
finish (at most --drain-timeout-s), then the proxy, the engines (each drains
too) and the store stop. A second signal stops at once.

SIGTERM to one engine's pid (not its process group) drains that engine: the
proxy stops routing to it at once, its requests in flight finish (same
bound), it exits and is not restarted; SIGUSR1 to fabric up restarts the
engines stopped that way.

Across hosts (a topology with hosts:), run fabric up --host NAME on each
machine: it starts that host's engines (and shared store), and the proxy
where proxy.host names it; the proxy reaches the other hosts' engines by
their addresses. Every host needs the same secret (connector.secret_env).

Under systemd, use KillMode=mixed (SIGTERM to fabric up alone, which stops
the engines in order) and TimeoutStopSec of at least twice --drain-timeout-s
plus 2 minutes; the default KillMode sends SIGTERM to every process at once,
vLLM's workers too, and fails the requests in flight.
"""


def _up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser(
        "up",
        help="start a topology's engines and proxy, keep them running (fabric up CONFIG)",
        description=UP_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("config", help="topology YAML, e.g. configs/1p1d.yaml")
    up.add_argument(
        "--host",
        help="in a topology across hosts: this machine's name under hosts: (start only "
        "its engines, its shared store, and the proxy if it runs here)",
    )
    up.add_argument(
        "--drain-timeout-s",
        type=_seconds("--drain-timeout-s", zero_ok=True),
        help="on SIGTERM, how long requests in flight may run on (proxy and each engine; "
        "default: 30)",
    )
    up.add_argument(
        "--restart-backoff-s",
        type=_seconds("--restart-backoff-s"),
        default=1.0,
        help="wait before the first restart of a process that exited (default 1)",
    )
    up.add_argument(
        "--restart-backoff-max-s",
        type=_seconds("--restart-backoff-max-s"),
        default=30.0,
        help="the longest wait between restarts of a crash loop (default 30)",
    )


def _seconds(flag: str, *, zero_ok: bool = False) -> Callable[[str], float]:
    """An argparse type: a number of seconds > 0 (>= 0 with ``zero_ok``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            bound = "a finite number >= 0" if zero_ok else "a finite number > 0"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    parse.__name__ = flag
    return parse


def _store_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    store = sub.add_parser("store", help="the shared chunk store (fabric store serve --help)")
    what = store.add_subparsers(dest="what", required=True)
    serve = what.add_parser(
        "serve", help="a host's shared store: engines attach to it and it outlives them"
    )
    serve.add_argument("--mem-gib", type=float, default=2.0, help="memory tier (default 2)")
    serve.add_argument("--disk-path", help="disk tier directory (default: none)")
    serve.add_argument("--disk-gib", type=float, default=16.0, help="disk budget (default 16)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument(
        "--advertise-host",
        help="address told to engines (default: the bind address; derived for 0.0.0.0)",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow a --host beyond loopback without --secret-env (anyone reaching it can write)",
    )
    serve.add_argument("--port", type=int, default=0, help="control port (default 0: free)")
    serve.add_argument("--endpoint-file", help="write the control endpoint here")
    serve.add_argument("--transport", default="auto", choices=["auto", "nixl", "tcp"])
    serve.add_argument("--secret-env", help="environment variable holding the shared secret")
    serve.add_argument(
        "--push-timeout-s", type=float, default=30.0, help="bound of a push to an engine"
    )


def _store(ns: argparse.Namespace) -> int:
    """``fabric store serve``: a config error is one message, exit status 2."""
    import logging
    import os

    from fabric.errors import ConfigError
    from fabric.shared_store.service import ServiceConfig, serve

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        secret = None
        if ns.secret_env is not None:
            secret = os.environ.get(ns.secret_env)
            if not secret:
                raise ConfigError(f"--secret-env: environment variable {ns.secret_env!r} is unset")
        config = ServiceConfig(
            mem_bytes=int(ns.mem_gib * 2**30),
            host=ns.host,
            advertise_host=ns.advertise_host,
            insecure=ns.insecure,
            port=ns.port,
            transport=ns.transport,
            disk_path=ns.disk_path,
            disk_gib=ns.disk_gib,
            endpoint_file=ns.endpoint_file,
            secret=secret,
            push_timeout_s=ns.push_timeout_s,
        )
        return serve(config, lambda line: print(line, flush=True))
    except ConfigError as exc:
        print(f"fabric store: {exc}", file=sys.stderr)
        return 2


def _k8s_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    k8s = sub.add_parser(
        "k8s",
        help="print a topology's Kubernetes manifests (fabric k8s CONFIG | kubectl apply -f -)",
    )
    k8s.add_argument("config", help="topology YAML, e.g. configs/1p1d.yaml")
    k8s.add_argument("-o", "--output", help="write the manifests here (default: stdout)")
    k8s.add_argument("--namespace", help="namespace of every object (default: k8s.namespace)")
    k8s.add_argument("--image", help="image with fabric and vLLM (default: k8s.image)")
    k8s.add_argument(
        "--secret-from-env",
        metavar="VAR",
        help="also render the Secret, with the value of environment variable VAR "
        "and the admin token proxy.admin_token_env names; -o writes a 0600 file "
        "(default: the Secret k8s.secret_name must exist)",
    )


def _k8s(ns: argparse.Namespace) -> int:
    """``fabric k8s``: a config error is one message, exit status 2."""
    from fabric.errors import ConfigError
    from fabric.launch.k8s import main as k8s_main

    try:
        return k8s_main(
            ns.config,
            output=ns.output,
            namespace=ns.namespace,
            image=ns.image,
            secret_from_env=ns.secret_from_env,
        )
    except ConfigError as exc:
        print(f"fabric k8s: {exc}", file=sys.stderr)
        return 2


def _bench(what: str, rest: list[str]) -> int:
    """``fabric bench transfer`` (the transfer sweep) / ``fabric bench serve``."""
    if what == "serve":
        from fabric.bench.serve_cli import main as bench_serve

        return bench_serve(rest)
    from fabric.bench.sweep_cli import main as bench_transfer

    return bench_transfer(rest)


def _serve(ns: argparse.Namespace) -> int:
    """``fabric up`` / ``fabric proxy``: a config error is one message, exit status 2."""
    import logging

    from fabric.errors import ConfigError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # NOTE: httpx logs every request at INFO: an access log by another name.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if ns.command == "up":
            from fabric.launch.supervisor import RestartPolicy
            from fabric.launch.up import UpOptions
            from fabric.launch.up import main as up_main

            restart = RestartPolicy(initial_s=ns.restart_backoff_s, max_s=ns.restart_backoff_max_s)
            options = UpOptions(drain_timeout_s=ns.drain_timeout_s, restart=restart, host=ns.host)
            return up_main(ns.config, options=options)
        from fabric.config import load_topology
        from fabric.router.serve import run_proxy

        run_proxy(load_topology(ns.config), host=ns.host, port=ns.port)
        return 0
    except ConfigError as exc:
        print(f"fabric {ns.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
