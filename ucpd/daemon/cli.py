"""``ucpd serve``, ``ucpd status`` and ``ucpd stop``: run a node daemon and look at it."""

from __future__ import annotations

import json
import logging
import os
import sys
import tomllib

from .. import knobs
from ..errors import UcpdError


def add_commands(sub) -> None:
    p = sub.add_parser("serve", help="run the node daemon", description="Run the ucpd node daemon in the foreground.")
    p.add_argument("--config", help="TOML file whose keys are these options (dashes or underscores)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index in the job (default 0)")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (daemons) in the job (default 1)")
    p.add_argument("--listen", help="tcp://HOST:PORT for peer daemons (multi-node)")
    p.add_argument("--peers", help="comma-separated --listen addresses of every node, in node order")
    p.add_argument("--secret-file", help="job secret that peers prove (default $UCPD_SECRET_FILE)")
    p.add_argument("--mem-limit", help="RAM for snapshot slots, e.g. 64G (default 80%% of free /dev/shm)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--replicas", type=int, help="copies of each version on buddy nodes")
    g.add_argument("--parity", type=int, help="erasure-code group size k across nodes")
    p.add_argument("--flush-dir", help="directory for the universal-format flush (none: no flush)")
    p.add_argument("--flush-every", type=int, default=None, help="flush every Nth committed version (default 1)")
    p.add_argument("--flush-rate", help="flush bandwidth limit in bytes/s, e.g. 2G (0: unlimited)")
    p.add_argument("--flush-keep", type=int, default=None, help="complete versions kept on disk (0: all)")
    p.add_argument("--keep", type=int, default=None, help="committed versions kept in RAM (default 2)")
    p.add_argument("--run-dir", help="socket directory (default $UCPD_RUN_DIR or /tmp/ucpd-$USER)")
    p.add_argument("--shm-dir", help="segment directory (default /dev/shm/ucpd-$USER-<node-rank>)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--idle-exit", type=float, default=None, help="exit after this many idle seconds (0: never)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=cmd_serve)

    s = sub.add_parser("status", help="show a daemon's versions, memory and flush progress")
    s.add_argument("--run-dir", help="the daemon's run dir (default $UCPD_RUN_DIR or /tmp/ucpd-$USER)")
    s.add_argument("--json", action="store_true", help="print JSON instead of tables")
    s.set_defaults(func=cmd_status)

    t = sub.add_parser("stop", help="stop a daemon (its shm segments stay for re-adoption)")
    t.add_argument("--run-dir")
    t.set_defaults(func=cmd_stop)


def _merged(args) -> dict:
    """Command-line options over the --config file's."""
    opts = {}
    if args.config:
        with open(args.config, "rb") as f:
            opts = {k.replace("-", "_"): v for k, v in tomllib.load(f).items()}
    for k, v in vars(args).items():
        if v is not None and k not in ("func", "command", "config"):
            opts[k] = v
    return opts


def config_from_args(args):
    from .server import DaemonConfig
    from .slots import shm_free_bytes

    o = _merged(args)
    nodes = int(o.get("nodes", 1))
    if nodes > 1 or o.get("peers") or o.get("replicas") or o.get("parity"):
        raise UcpdError(
            "multi-node redundancy (--nodes > 1, --peers, --replicas, --parity) is not available in this build: "
            "run one daemon per node with --nodes 1 and a --flush-dir for durability"
        )
    node_rank = int(o.get("node_rank", 0))
    shm_dir = o.get("shm_dir") or knobs.shm_dir(node_rank)
    mem_limit = knobs.parse_size(o["mem_limit"]) if o.get("mem_limit") else knobs.mem_limit()
    if not mem_limit:  # 80% of what the shm file system can give us, counting our own segments
        where = shm_dir if os.path.isdir(shm_dir) else os.path.dirname(shm_dir)
        ours = sum(e.stat().st_size for e in os.scandir(shm_dir) if e.name.startswith("slot-")) if os.path.isdir(shm_dir) else 0
        mem_limit = int((shm_free_bytes(where) + ours) * 0.8)
    return DaemonConfig(
        run_dir=o.get("run_dir") or knobs.run_dir(),
        shm_dir=shm_dir,
        mem_limit=mem_limit,
        keep=int(o.get("keep", knobs.keep_versions())),
        node_rank=node_rank,
        nodes=nodes,
        flush_dir=o.get("flush_dir"),
        flush_every=int(o.get("flush_every", 1)),
        flush_rate=float(knobs.parse_size(o["flush_rate"])) if o.get("flush_rate") is not None else knobs.flush_rate(),
        flush_keep=int(o.get("flush_keep", 0)),
        idle_exit=float(o.get("idle_exit", 0)),
        metrics_port=o.get("metrics_port"),
    )


def cmd_serve(args) -> int:
    from .server import Daemon

    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO), format="%(asctime)s ucpd %(levelname)s %(message)s")
    daemon = Daemon(config_from_args(args))
    for note in daemon.store.adopted.dropped:
        print(f"ucpd: re-adoption: {note}", file=sys.stderr)
    if daemon.store.table.versions:
        print(f"ucpd: re-adopted {len(daemon.store.table.versions)} version(s) from {daemon.config.shm_dir}", file=sys.stderr)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: setattr(daemon, "_stop", True))
    daemon.serve()
    return 0


def _client(run_dir):
    from ..rpc import Connection

    return Connection(run_dir or knobs.run_dir(), timeout=10.0)


def cmd_status(args) -> int:
    with _client(args.run_dir) as conn:
        status = conn.call("status")
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        from rich.console import Console

        from .status import render

        render(status, Console())
    return 0


def cmd_stop(args) -> int:
    with _client(args.run_dir) as conn:
        conn.call("shutdown")
    return 0
