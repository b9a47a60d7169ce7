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
