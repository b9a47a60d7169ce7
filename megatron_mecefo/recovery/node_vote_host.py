"""The node-level commit vote in supervised runs (issue 43, item 9).

The supervisor hosts a :class:`~.node_vote.NodeVoteServer` on a Unix socket, and its ranks
vote through a :class:`~.node_vote.NodeVoteClient` instead of :class:`~.commit.AsyncVoter`:
the node's ranks' votes are gathered locally and the node casts one vote on the hot store, so
the store serves one ``add`` (and one wait) per node per iteration, not per rank. A job of
more nodes than ``--vote-group-size`` (default 32) also gathers the nodes' votes per group on
the group's head, which casts one vote per group (:mod:`.group_vote`).

On by default in ``--store-mode etcd`` with more than one node (the node vote passes
``tests/integration/recovery/test_etcd_mode.py``: a vote cut off by a takeover is in doubt,
one of a later generation is cast again on the new leader's store,
:func:`.commit.vote_after_failover`). ``MECEFO_NODE_VOTE=1`` switches it on in any mode,
``MECEFO_NODE_VOTE=0`` off. The supervisor calls :func:`host` once its store is open and adds
:func:`rank_env` to each rank's environment; the rank's session calls :func:`voter`. Every
node of a job must take the same choice (the counter counts nodes under it, ranks without
it): the default follows the job's flags, which every node shares; set the variable on all
nodes or none.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Dict, Optional

SWITCH = "MECEFO_NODE_VOTE"
"""``1``: vote per node in any store mode; ``0``: per rank; unset: per node in multi-node
``--store-mode etcd``."""
SOCKET_ENV = "MECEFO_NODE_VOTE_SOCKET"
"""What a rank gets: its node's vote socket."""
NPROC_ENV = "MECEFO_NODE_VOTE_NPROC"
"""What a rank gets: the ranks per node (slot ``s`` is on node ``s // nproc``)."""


def enabled(environ: Optional[Dict[str, str]] = None, store: str = "", nnodes: int = 1) -> bool:
    """Whether the node vote is on for a job of ``nnodes`` on the store ``store``."""
    value = (environ if environ is not None else os.environ).get(SWITCH, "")
    if value in ("0", "1"):
        return value == "1"
    return store.startswith("etcd://") and nnodes > 1


def host(
    store: str,
    node: int,
    poll_interval_s: float,
    nnodes: int = 1,
    group_size: int = 0,
    group_host: str = "127.0.0.1",
) -> Optional[Any]:
    """The node's vote server when the node vote is on (else None). The vote's store client
    raises ``StoreFailedOver`` (etcd mode: a vote cut off by the leader's loss is not applied;
    :mod:`.commit`); the abort and bookkeeping client follows the store. A job of more than
    ``group_size`` nodes also serves a group store on ``group_host`` (:mod:`.group_vote`)."""
    if not enabled(store=store, nnodes=nnodes):
        return None
    from megatron_mecefo.recovery.membership import MembershipStore
    from megatron_mecefo.recovery.node_vote import NodeVoteServer

    path = os.path.join(tempfile.gettempdir(), f"mecefo-vote-{os.getpid()}-{node}.sock")
    groups = group_size if 0 < group_size < nnodes else 0
    if groups and group_host in ("127.0.0.1", "localhost", "::1"):
        # The default --store-host; the group store listens on every interface, and the
        # other nodes reach this one by its name.
        group_host = socket.gethostname()
    print(
        f"[supervisor node {node}] node vote: this node's ranks vote through {path}"
        + (f"; nodes vote in groups of {groups}" if groups else ""),
        flush=True,
    )
    return NodeVoteServer(
        path, store, node=node, poll_interval_s=poll_interval_s,
        vote_membership=lambda: MembershipStore.connect(store, raise_on_failover=True),
        group_size=groups, group_host=group_host,
    )  # fmt: skip


def rank_env(server: Optional[Any], nproc_per_node: int) -> Dict[str, str]:
    """The environment a rank needs to vote through ``server`` (empty without one)."""
    if server is None:
        return {}
    return {SOCKET_ENV: server.path, NPROC_ENV: str(nproc_per_node)}


def voter(store: str, poll_interval_s: float, decision_wait_s: float) -> Any:
    """A rank's voter: its node's :class:`~.node_vote.NodeVoteClient` when the supervisor
    hosts one, else an :class:`~.commit.AsyncVoter` on the store."""
    path = os.environ.get(SOCKET_ENV)
    if not path:
        from megatron_mecefo.recovery.commit import AsyncVoter

        return AsyncVoter(store, poll_interval_s, decision_wait_s)
    from megatron_mecefo.recovery.node_vote import NodeVoteClient

    nproc = int(os.environ[NPROC_ENV])
    return NodeVoteClient(path, lambda slot: slot // nproc)
