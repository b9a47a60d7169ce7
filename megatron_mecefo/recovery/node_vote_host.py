"""The node-level commit vote in supervised runs (issue 43, item 9), behind a switch.

With ``MECEFO_NODE_VOTE=1`` in a supervisor's environment, the supervisor hosts a
:class:`~.node_vote.NodeVoteServer` on a Unix socket, and its ranks vote through a
:class:`~.node_vote.NodeVoteClient` instead of :class:`~.commit.AsyncVoter`: the node's
ranks' votes are gathered locally and the node casts one vote on the hot store, so the
store serves one ``add`` (and one wait) per node per iteration, not per rank. Off by default:
it is tested in-process (``tests/unit/recovery/test_node_vote.py``,
``tests/unit/recovery/test_node_vote_host.py``) and in failure-free supervised DP4 runs,
but switched on it fails 3 of the 4 tests of ``tests/integration/recovery/test_etcd_mode.py``:
after a takeover, the node's casting client raises ``StoreFailedOver`` for the first vote of
the new generation (it only met the old store), and the node reports the vote lost instead
of casting it again on the new store as :meth:`.commit.AsyncVoter._after_failover` does; the
extra regroup breaks those tests' expectations (and the SIGSTOP test's time bound).

The supervisor calls :func:`host` once its store is open and adds :func:`rank_env` to each
rank's environment; the rank's session calls :func:`voter`. Every node of a job must use the
same switch: the counter counts nodes under it, ranks without it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, Optional

SWITCH = "MECEFO_NODE_VOTE"
"""Set to ``1`` in the supervisors' environment to vote per node."""
SOCKET_ENV = "MECEFO_NODE_VOTE_SOCKET"
"""What a rank gets: its node's vote socket."""
NPROC_ENV = "MECEFO_NODE_VOTE_NPROC"
"""What a rank gets: the ranks per node (slot ``s`` is on node ``s // nproc``)."""


def enabled(environ: Optional[Dict[str, str]] = None) -> bool:
    return (environ if environ is not None else os.environ).get(SWITCH, "") == "1"


def host(store: str, node: int, poll_interval_s: float) -> Optional[Any]:
    """The node's vote server when the switch is on (else None). The vote's store client
    raises ``StoreFailedOver`` (etcd mode: a vote cut off by the leader's loss is not applied;
    :mod:`.commit`); the abort and bookkeeping client follows the store."""
    if not enabled():
        return None
    from megatron_mecefo.recovery.membership import MembershipStore
    from megatron_mecefo.recovery.node_vote import NodeVoteServer

    path = os.path.join(tempfile.gettempdir(), f"mecefo-vote-{os.getpid()}-{node}.sock")
    print(f"[supervisor node {node}] node vote: this node's ranks vote through {path}", flush=True)
    return NodeVoteServer(
        path, store, node=node, poll_interval_s=poll_interval_s,
        vote_membership=lambda: MembershipStore.connect(store, raise_on_failover=True),
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
