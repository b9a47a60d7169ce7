"""A loopback ``--store-host`` in a multi-node ``--store-mode etcd`` job is refused at start-up
with one line: should that node lead, every other node would connect to its own machine, be
refused, and revoke the leader's lease. Allowed where etcd is on loopback too (every node on
one machine, as in the tests), and on one node."""

from __future__ import annotations

import pytest

from megatron_mecefo.recovery.config import RecoveryConfigError
from megatron_mecefo.recovery.supervisor import main
from megatron_mecefo.recovery.supervisor_args import build_parser, validate

CLUSTER = "10.1.0.1:2379,10.1.0.2:2379,10.1.0.3:2379"
LOCAL = "127.0.0.1:2379,127.0.0.1:2381,127.0.0.1:2383"


def _parse(flags: list):
    args = build_parser().parse_args(["--nproc-per-node", "1", *flags, "--", "-m", "trainer"])
    args.command = args.command[1:]
    return args


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]"])
def test_a_loopback_store_host_is_refused_with_the_fix(host: str) -> None:
    flags = ["--nnodes", "2", "--store-mode", "etcd", "--etcd", CLUSTER, "--store-host", host]
    with pytest.raises(RecoveryConfigError) as caught:
        validate(_parse(flags))
    line = str(caught.value)
    assert "\n" not in line
    for words in (f"--store-host {host}", "loopback", "2-node", "hostname"):
        assert words in line, line


def test_the_default_store_host_is_refused_in_one_line(capsys: pytest.CaptureFixture) -> None:
    """The default ``--store-host`` (127.0.0.1): one error line, exit 2, nothing started."""
    code = main(["--nproc-per-node", "1", "--nnodes", "2", "--store-mode", "etcd", "--etcd",
                 CLUSTER, "--", "-m", "trainer"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--store-host 127.0.0.1" in err[0], (code, err)


@pytest.mark.parametrize(
    "flags",
    [
        ["--nnodes", "2", "--store-mode", "etcd", "--etcd", LOCAL],  # one machine
        ["--nnodes", "1", "--store-mode", "etcd", "--etcd", CLUSTER],  # one node
        ["--nnodes", "2", "--store-mode", "etcd", "--etcd", CLUSTER, "--store-host", "10.1.0.9"],
        ["--nnodes", "2", "--node-rank", "1", "--store", "10.1.0.9:5000"],  # single store
    ],
)
def test_other_store_hosts_are_accepted(flags: list) -> None:
    validate(_parse(flags))


def test_grpc_loads_with_its_fork_support_off() -> None:
    """The start-up check of the etcd client (``--store-mode etcd``) must not be the first to
    load grpc: grpc reads ``GRPC_ENABLE_FORK_SUPPORT`` once, as it loads, and a supervisor
    whose grpc loaded with it unset forked its ranks with grpc's fork handlers on (a rank died
    of SIGABRT at start-up, at random: "skipping fork() handlers", "epoll_wait error")."""
    import subprocess
    import sys

    probe = (
        "import os, sys\n"
        "class Seen:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'grpc':\n"
        "            print('at-import', os.environ.get('GRPC_ENABLE_FORK_SUPPORT'))\n"
        "        return None\n"
        "sys.meta_path.insert(0, Seen())\n"
        "os.environ.pop('GRPC_ENABLE_FORK_SUPPORT', None)\n"
        "from megatron_mecefo.recovery import supervisor_args\n"
        "assert 'grpc' not in sys.modules\n"
        "supervisor_args._check_etcd_client()\n"
        "assert 'grpc' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["at-import", "false"], out.stdout
