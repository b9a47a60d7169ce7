"""The recovery supervisor's command line: its flags, their checks, and its one-line errors.

:func:`build_parser` defines the flags (``scripts/render_flags.py`` renders them into
docs/flags.md); :func:`validate` checks them against each other and the world before any
process starts and turns them into a :class:`~.config.RecoveryConfig`.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from typing import Iterable, List

from megatron_mecefo.errors import UserError, check_writable_dir, check_writable_file
from megatron_mecefo.recovery.config import RecoveryConfig, RecoveryConfigError

PROG = "megatron_mecefo.recovery.supervisor"


class SupervisorError(UserError):
    """An expected error of the supervisor (a store, a node, a file): one line, exit 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message, usage=False)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage dump), exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{PROG}: error: {message} (--help lists the flags)", file=sys.stderr, flush=True)
        sys.exit(2)


REPLICATED_REMOVED = (
    "'replicated' was removed (the primary/standby store: it could roll a generation back and "
    "fenced nothing); for two nodes or more use --store-mode etcd --etcd HOST:PORT,... (see "
    "docs/cluster.md), on one node --store-mode single"
)
"""What argparse prints after ``argument --store-mode:`` for the removed mode."""


def _store_mode(value: str) -> str:
    """``--store-mode``: a removed mode is one line naming the fix (argparse's choices would
    only list the others)."""
    if value == "replicated":
        raise argparse.ArgumentTypeError(REPLICATED_REMOVED)
    return value


def build_parser() -> argparse.ArgumentParser:
    """The supervisor's flags, then ``-- script.py [args]``."""
    p = _Parser(
        prog=PROG,
        description="Start one node's training ranks; survive rank deaths (MeCeFO).",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        required=True,
        help="training ranks (processes) this supervisor starts on its node",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes of the job, one supervisor each; world size = nnodes x nproc-per-node",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index, 0..nnodes-1 (its ranks start at node-rank x nproc-per-node); "
        "node 0 hosts the membership store",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="HOST:PORT",
        help="store of node 0 (as its supervisor prints it, or its --store-file holds); not "
        "needed with --store-mode etcd",
    )
    p.add_argument(
        "--store-host",
        default="127.0.0.1",
        help="node 0 (--store-mode etcd: any node, should it lead): address to serve the store on",
    )
    p.add_argument(
        "--store-port",
        type=int,
        default=0,
        help="node 0: TCP port of the membership store; 0 = any free port",
    )
    p.add_argument(
        "--store-file",
        default=None,
        help="node 0: write HOST:PORT here (--store-mode etcd: any node, the etcd:// address a "
        "joining or rejoining node may pass as --store)",
    )
    p.add_argument(
        "--store-mode",
        default="single",
        type=_store_mode,
        choices=("single", "etcd"),
        help="single: node 0 alone serves the membership store (its loss ends the job); etcd: "
        "the supervisors elect a leader on the etcd cluster of --etcd, which serves the store "
        "and coordinates; any node, the leader's included, can be lost, again and again, "
        "while etcd keeps a quorum (every node passes the same mode and --etcd; --store is "
        "then not needed)",
    )
    p.add_argument(
        "--etcd",
        default=None,
        metavar="HOST:PORT,...",
        help="--store-mode etcd: the client endpoints of every etcd member (e.g. three), "
        "comma-separated, plain HTTP (https:// is refused: no TLS); the job's keys live under "
        "/mecefo/<MECEFO_JOB_ID, else SLURM_JOB_ID, else a digest of --nnodes, "
        "--nproc-per-node and the command>, so two jobs on one etcd need different ids, and a "
        "node 0 whose prefix holds a live job is refused",
    )
    d = RecoveryConfig()
    p.add_argument("--replace", default=d.replace, help="never | immediately | after:SECONDS")
    p.add_argument(
        "--orphan",
        default=d.orphan,
        choices=("wait", "exit"),
        help="what the live TP/PP siblings of a dead rank do: wait as spares for the rejoin, "
        "or exit (their slots are then replaced like dead ones)",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=d.heartbeat_interval_s,
        help="seconds between two heartbeats of a rank (and between the coordinator's checks)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=d.heartbeat_timeout_s,
        help="seconds without a heartbeat after which a rank counts as dead (hung) and is "
        "SIGKILLed; above --heartbeat-interval",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=d.collective_timeout_s,
        help="seconds: backstop timeout of every process group, for a collective a death does "
        "not wake; above --heartbeat-timeout",
    )
    p.add_argument(
        "--init-timeout",
        type=float,
        default=d.init_timeout_s,
        help="seconds to wait for the store, the other nodes and each new world's rendezvous; "
        "above --collective-timeout",
    )
    p.add_argument(
        "--join-margin",
        type=int,
        default=d.join_margin_iterations,
        help="iterations after the last committed one at which a rejoin takes effect (>= 2), "
        "so every rank sees the plan first",
    )
    p.add_argument(
        "--vote-group-size",
        type=int,
        default=d.vote_group_size,
        help="nodes per group of the two-level commit vote (a job of more nodes votes per "
        "group on the hot store; 0: never); every node of a job must pass the same value",
    )
    p.add_argument(
        "--no-warm-heap",
        dest="warm_heap",
        action="store_false",
        help="CPU ranks: a joining rank does not fault in its heap while it waits for its world "
        "(by default it does, and its heal writes into resident pages)",
    )
    p.add_argument("--records", default=None, help="JSONL file for the recovery records")
    p.add_argument(
        "--max-replacements",
        type=int,
        default=8,
        help="most replacements started for one rank slot",
    )
    p.add_argument(
        "--replace-ranks",
        default=None,
        metavar="R1,R2,...",
        help="only these (original) ranks get replacements; default: every rank",
    )
    p.add_argument("--pid-file", default=None, help="append 'SLOT INCARNATION PID' per rank")
    p.add_argument(
        "--standby",
        type=int,
        default=0,
        help="warm standby processes per node (imported, waiting): a replacement then takes "
        "over a dead rank's slot in about a second instead of a cold start",
    )
    p.add_argument(
        "--rejoin",
        action="store_true",
        help="this node replaces a lost one in a running job (same --node-rank, --store of "
        "node 0): its ranks start as the next incarnation once the old ones are known dead",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [args]")
    return p


def validate(args: argparse.Namespace) -> RecoveryConfig:
    """Every flag against the others and the world, before any process starts.

    Raises:
        RecoveryConfigError: A bad flag (exit 2); the message names it and the fix.
    """
    command = args.command
    if not command:
        raise RecoveryConfigError("no command: add -- script.py [args] after the flags")
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise RecoveryConfigError(
            f"--nproc-per-node={args.nproc_per_node} --nnodes={args.nnodes} --node-rank="
            f"{args.node_rank}: need >= 1 process, >= 1 node and 0 <= node rank < nodes"
        )
    world = args.nproc_per_node * args.nnodes
    if args.replace_ranks:
        try:
            ranks = {int(r) for r in args.replace_ranks.split(",")}
        except ValueError:
            raise RecoveryConfigError(
                f"--replace-ranks={args.replace_ranks}: expected comma-separated ranks"
            ) from None
        bad = sorted(r for r in ranks if not 0 <= r < world)
        if bad:
            raise RecoveryConfigError(
                f"--replace-ranks={args.replace_ranks}: rank {rank_list(bad)} does not exist "
                f"(world size {world}: ranks 0..{world - 1}); name existing ranks"
            )
        if args.replace == "never":
            raise RecoveryConfigError(
                f"--replace-ranks={args.replace_ranks} has no effect with --replace never; add "
                "--replace immediately or --replace after:SECONDS"
            )
        args.replace_ranks = ranks
    for flag, value in (("--max-replacements", args.max_replacements),
                        ("--standby", args.standby)):  # fmt: skip
        if value < 0:
            raise RecoveryConfigError(f"{flag}={value}: must be >= 0; pass 0 or more")
    if not 0 <= args.store_port <= 65535:
        raise RecoveryConfigError(
            f"--store-port={args.store_port}: not a TCP port; pass 1..65535, or 0 for any free one"
        )
    if args.node_rank == 0 and args.store_port:
        _check_port_free(args.store_host, args.store_port)
    args.etcd_endpoints = _etcd_endpoints(args)
    _check_store_host_reachable(args)
    if args.store_mode == "etcd":
        _check_etcd_client()
    elif args.store is not None and args.store.strip().startswith("etcd://"):
        endpoints = args.store.strip()[len("etcd://") :].split("/", 1)[0] or "HOST:PORT,..."
        raise RecoveryConfigError(
            f"--store {args.store}: an etcd:// address is the store of --store-mode etcd, "
            f"which this node was not given; add --store-mode etcd --etcd {endpoints} (every "
            "node of the job passes both; --store is then not needed)"
        )
    elif args.store is not None:
        host, _, port = args.store.strip().rpartition(":")
        if not host or "," in host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise RecoveryConfigError(
                f"--store {args.store}: expected HOST:PORT of node 0's membership store (as "
                "its supervisor prints it, or its --store-file holds)"
            )
    if args.rejoin and not args.store and args.store_mode != "etcd":
        raise RecoveryConfigError(
            f"--rejoin --node-rank={args.node_rank}: a rejoining node needs --store: node 0's "
            "HOST:PORT (as its supervisor prints it, or its --store-file holds)"
        )
    if args.rejoin and args.node_rank == 0 and args.store_mode == "single":
        raise RecoveryConfigError(
            "--rejoin --node-rank=0: node 0 hosts the store in --store-mode single, so it "
            "cannot be lost and come back; run every node with --store-mode etcd --etcd "
            "HOST:PORT,... (see docs/cluster.md)"
        )
    if args.node_rank > 0 and not args.store and args.store_mode != "etcd":
        raise RecoveryConfigError(
            f"--node-rank={args.node_rank} needs --store HOST:PORT (node 0's store)"
        )
    if args.node_rank == 0 and args.store and not args.rejoin and args.store_mode != "etcd":
        raise RecoveryConfigError(
            f"--store {args.store} with --node-rank 0: node 0 hosts the store (--store-host, "
            "--store-port); drop --store, or pass the node rank of this node"
        )
    script = command[0]
    if script != "-m" and script.endswith(".py") and not os.path.isfile(script):
        raise RecoveryConfigError(
            f"{script}: no such file (the command after --); pass the trainer's path, e.g. "
            "-- examples/pretrain_gpt/pretrain_gpt.py"
        )
    for flag, path in (("--records", args.records), ("--pid-file", args.pid_file)):
        if path:
            check_writable_file(flag, path)
    if args.store_file:
        check_writable_dir("--store-file", os.path.dirname(os.path.abspath(args.store_file)))
    return RecoveryConfig(
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        collective_timeout_s=args.collective_timeout,
        init_timeout_s=args.init_timeout,
        replace=args.replace,
        orphan=args.orphan,
        join_margin_iterations=args.join_margin,
        vote_group_size=args.vote_group_size,
        warm_heap=args.warm_heap,
        records_file=os.path.abspath(args.records) if args.records else None,
    ).validate()


def _etcd_endpoints(args: argparse.Namespace) -> List[str]:
    """``--etcd`` as a list of ``HOST:PORT`` (empty without etcd mode); one line naming the
    flag, the value and the fix when it is missing or malformed."""
    if args.store_mode != "etcd":
        if args.etcd:
            raise RecoveryConfigError(
                f"--etcd {args.etcd} is only used with --store-mode etcd; add --store-mode "
                "etcd, or drop --etcd"
            )
        return []
    if not args.etcd:
        raise RecoveryConfigError(
            "--store-mode etcd needs --etcd HOST:PORT,... (the client endpoints of every etcd "
            "member, e.g. three); pass them, or use --store-mode single"
        )
    endpoints = [e.strip().removeprefix("http://") for e in args.etcd.split(",") if e.strip()]
    for e in endpoints:
        if e.lower().startswith("https://"):
            plain = ",".join(x.split("://")[-1].split("/")[0] for x in endpoints)
            raise RecoveryConfigError(
                f"--etcd {args.etcd}: '{e}': TLS (https://) is not supported; serve etcd's "
                "client URLs over plain HTTP on the cluster's private network and pass "
                f"HOST:PORT (e.g. --etcd {plain})"
            )
        if "://" in e:
            raise RecoveryConfigError(
                f"--etcd {args.etcd}: '{e}': only HOST:PORT (or http://HOST:PORT) is "
                "supported; pass every etcd member's client address, comma-separated"
            )
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise RecoveryConfigError(
                f"--etcd {args.etcd}: '{e}' is not HOST:PORT; pass every etcd member's client "
                "address, comma-separated (e.g. --etcd n1:2379,n2:2379,n3:2379)"
            )
    if len(set(endpoints)) != len(endpoints):
        raise RecoveryConfigError(
            f"--etcd {args.etcd}: an endpoint is listed twice; list each etcd member once"
        )
    return endpoints


ETCD_CLIENT_FIX = (
    "reinstall megatron-mecefo (pip install -e . from the checkout brings it), or pip install "
    "'etcd-sdk-python>=0.0.7' 'protobuf>=5.27.2'"
)


def _check_etcd_client() -> None:
    """``--store-mode etcd`` needs the etcd client (``etcd-sdk-python``: module ``pyetcd``, and
    grpcio and protobuf under it); imported here, before any process starts, so that a
    missing or broken one is one line naming the fix, not a traceback later."""
    try:
        # Through etcd_transport, which turns grpc's fork support off before grpc first loads:
        # grpc reads the setting once, and a supervisor that imported it here first forked its
        # ranks with grpc's fork handlers on (a rank died of SIGABRT at start-up, at random).
        import megatron_mecefo.recovery.etcd_transport  # noqa: F401
    except Exception as err:  # noqa: BLE001 (ImportError, protobuf's VersionError and kin)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise SupervisorError(
            f"--store-mode etcd needs the etcd client etcd-sdk-python, which does not import "
            f"here ({type(err).__name__}: {first}); {ETCD_CLIENT_FIX}"
        ) from None


def _loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (127.x, localhost, ::1)."""
    host = host.strip().strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.") or host.endswith(".localhost")


def _check_store_host_reachable(args: argparse.Namespace) -> None:
    """``--store-mode etcd`` on several nodes: any node may lead and serve the store, so its
    ``--store-host`` must be an address the other nodes reach. A loopback one (the default)
    sends every follower to its own machine, where nothing listens: each then finds the
    leader's store refusing connections. Allowed only where etcd is on loopback too (every
    node on one machine, as in a test)."""
    if args.store_mode != "etcd" or args.nnodes <= 1 or not _loopback(args.store_host):
        return
    if all(_loopback(e.rpartition(":")[0]) for e in args.etcd_endpoints):
        return
    raise RecoveryConfigError(
        f"--store-host {args.store_host}: a loopback address in a {args.nnodes}-node "
        "--store-mode etcd job; the other nodes cannot reach a store served there should this "
        "node lead: pass this node's hostname or an address the other nodes reach"
    )


def _check_port_free(host: str, port: int) -> None:
    """Node 0's store port, tried before torch is imported (the store's own bind error, later,
    covers a port taken in between)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds
        try:
            probe.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise SupervisorError(
                    f"--store-port {port}: the address {host}:{port} is already in use "
                    "(another job or supervisor?); pass another --store-port, or 0 for any "
                    "free port"
                ) from None
            raise SupervisorError(
                f"--store-host {host}: cannot serve the membership store at {host}:{port} "
                f"({err.strerror}); pass a --store-host of this machine (its hostname or one "
                "of its addresses)"
            ) from None


def rank_list(numbers: Iterable[int]) -> str:
    """``0, 3, 5``: ranks or nodes in a message."""
    return ", ".join(str(n) for n in numbers)
