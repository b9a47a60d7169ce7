"""The supervisor's ``--store-mode`` checks: the removed ``replicated`` mode is one line naming
the fix; a node 0 may rejoin only where its loss is survived (etcd mode); ``--store`` is one
``HOST:PORT``."""

from __future__ import annotations

import pytest

from megatron_mecefo.recovery.config import RecoveryConfigError
from megatron_mecefo.recovery.supervisor_args import build_parser, validate


def _parse(flags: list):
    """The supervisor's flags with a trainer command (``-m trainer``: no file to check)."""
    args = build_parser().parse_args(["--nproc-per-node", "1", *flags, "--", "-m", "trainer"])
    args.command = args.command[1:]  # as main() drops the "--"
    return args


def test_replicated_mode_is_refused_with_the_fix(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--nnodes", "2", "--store-mode", "replicated"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    for words in ("--store-mode", "'replicated' was removed",
                  "--store-mode etcd --etcd HOST:PORT,...", "docs/cluster.md"):  # fmt: skip
        assert words in lines[0], lines[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2", "--node-rank", "0", "--rejoin", "--store", "h:1"],
         "--rejoin --node-rank=0: node 0 hosts the store in --store-mode single"),
        (["--nnodes", "2", "--node-rank", "1", "--store", "h:1,h:2"],
         "expected HOST:PORT of node 0's membership store"),
    ],
)  # fmt: skip
def test_store_flags_are_checked(flags: list, message: str) -> None:
    with pytest.raises(RecoveryConfigError, match=message.replace("(", r"\(")):
        validate(_parse(flags))


def test_a_new_node0_may_rejoin_in_etcd_mode() -> None:
    args = _parse(["--nnodes", "2", "--node-rank", "0", "--rejoin", "--store-mode", "etcd",
                   "--etcd", "127.0.0.1:2379,127.0.0.1:2381,127.0.0.1:2383"])  # fmt: skip
    validate(args)  # accepted: the store is found through etcd at run time
    assert args.etcd_endpoints == ["127.0.0.1:2379", "127.0.0.1:2381", "127.0.0.1:2383"]


def _etcd_node(node: int, *flags: str, command: str = "trainer") -> object:
    args = build_parser().parse_args(
        ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(node), "--store-mode",
         "etcd", "--etcd", "127.0.0.1:2379", *flags, "--", "-m", command]
    )  # fmt: skip
    args.command = args.command[1:]
    return args


def test_etcd_prefix_is_the_same_on_every_node_of_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a job id the key prefix is a digest of what every node of a job passes alike:
    a --store-port or --store-host that one node passes and another not leaves it unchanged
    (it used to come from --store-port), and another command gives another prefix."""
    from megatron_mecefo.recovery.store_host import etcd_prefix

    monkeypatch.delenv("MECEFO_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    node0 = etcd_prefix(_etcd_node(0, "--store-port", "29500", "--store-host", "n0"))
    node1 = etcd_prefix(_etcd_node(1, "--store-host", "n1"))
    assert node0 == node1 and node0.startswith("/mecefo/cmd-"), (node0, node1)
    assert etcd_prefix(_etcd_node(0, command="other")) != node0
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert etcd_prefix(_etcd_node(1)) == "/mecefo/123"
    monkeypatch.setenv("MECEFO_JOB_ID", "mine")
    assert etcd_prefix(_etcd_node(1)) == "/mecefo/mine"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--store-mode", "etcd", "--etcd", "127.0.0.1:2379,https://h:2379"],
         "TLS (https://) is not supported"),
        (["--store-mode", "etcd", "--etcd", "unix://sock:1"], "only HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "1", "--store", "etcd://a:1,b:2/mecefo/j?ttl=8"],
         "add --store-mode etcd --etcd a:1,b:2"),
    ],
)  # fmt: skip
def test_etcd_addresses_are_checked(flags: list, message: str) -> None:
    with pytest.raises(RecoveryConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(_parse(flags))
