"""Issue 34: every mistake a user can make ends in one clear line (docs/errors.md), one row per
mistake. Each row runs the real program (the example trainer, torchrun, the recovery
supervisor) as a user would and asserts the exit code, the one line and its key words, that
no traceback was printed, and that no process of the row is left (each row's processes carry
a marker in their environment; any left are listed, then killed by PID).

Start-up rows fail before a model is built (a few seconds at most) and run in ``make test``;
rows that train or build a model are ``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import REPO, TRAINER, child_env, free_port
from user_error_rows import MOCK, PY, ROWS, Row


# ---------------------------------------------------------------- fixtures the rows name
def _write_dataset(prefix: Path, documents: list[list[int]], dtype: object) -> None:
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        builder.add_document(torch.tensor(np.array(doc, dtype=dtype)), [len(doc)])
    builder.finalize(f"{prefix}.idx")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Datasets and files made by something else: another tokenizer (ids up to 50000), an
    empty one, one shorter than a sample, a truncated one; an old planner profile and a trace
    of an eight-replica run."""
    import numpy as np

    root = tmp_path_factory.mktemp("foreign_data")
    rng = np.random.default_rng(0)
    good = [list(rng.integers(0, 256, 200)) + [256] for _ in range(20)]
    _write_dataset(root / "good", good, np.uint16)
    _write_dataset(root / "foreign", good[:5] + [[50000, 17, 3]], np.uint16)
    _write_dataset(root / "empty", [], np.uint16)
    _write_dataset(root / "short", [list(range(10))], np.uint16)
    _write_dataset(root / "truncated", good, np.uint16)
    binf = root / "truncated.bin"
    binf.write_bytes(binf.read_bytes()[: binf.stat().st_size // 2])
    profile = json.loads((REPO / "results" / "planner_profile.json").read_text())
    profile["written_by_v0"] = 1
    (root / "old_profile.json").write_text(json.dumps(profile))
    trace = {"events": [{"replica": 7, "fail_iteration": 2, "recover_iteration": 4}]}
    (root / "trace_dp8.json").write_text(json.dumps(trace))
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A real checkpoint of a 2-iteration run (plain ``python``: one process, no launcher;
    --use-distributed-optimizer, so its optimizer state is saved per rank on the CPU), and
    copies: without the run record (a checkpoint of an earlier version), with a newer or a
    damaged record, with a garbage tracker."""
    root = tmp_path_factory.mktemp("ckpt")
    save = root / "save"
    proc = subprocess.run(
        [PY, str(TRAINER), *MOCK, "--train-iters", "2", "--use-distributed-optimizer",
         "--save", str(save)],
        cwd=root, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = Path("iter_0000002") / "mecefo_run.json"
    assert (save / record).exists()
    out = {"ckpt": str(save)}
    for name, change in (("old", None), ("newer", "format"), ("garbage", "garbage"),
                         ("tracker", "tracker")):  # fmt: skip
        copy = root / name
        shutil.copytree(save, copy)
        if change is None:
            (copy / record).unlink()
        elif change == "format":
            saved = json.loads((copy / record).read_text())
            (copy / record).write_text(json.dumps({**saved, "format": 99}))
        elif change == "garbage":
            (copy / record).write_text("{not json")
        else:
            (copy / "latest_checkpointed_iteration.txt").write_text("\x00garbage")
        out[f"ckpt_{name}"] = str(copy)
    return out


@pytest.fixture
def holder(tmp_path: Path) -> dict[str, str]:
    """A snapshot holder (shared memory) holding the snapshots of a 3-iteration run of the
    small model; stopped by PID afterwards."""
    directory = Path("/dev/shm" if Path("/dev/shm").is_dir() else tmp_path) / (
        f"mecefo-test-{uuid.uuid4().hex[:8]}"
    )
    proc = subprocess.Popen(
        [PY, "-m", "megatron_mecefo.snapshot.holder", "--dir", str(directory)],
        env=child_env(), start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (directory / "holder.pid").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no snapshot holder"
            time.sleep(0.05)
        run = subprocess.run(
            [PY, str(TRAINER), *MOCK, "--train-iters", "3", "--mecefo-snapshot-interval", "1",
             "--mecefo-snapshot-dir", str(directory)],
            cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        yield {"holder": str(directory)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def mlm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Megatron-LM core_v0.16.1 from ``../shared/megatron-lm``, unpacked and patched."""
    from mlm_runs import unpack_megatron_lm

    tree = unpack_megatron_lm(tmp_path_factory.mktemp("megatron_lm"))
    if tree is None:
        pytest.skip("no Megatron-LM tarball at ../shared/megatron-lm (set MEGATRON_LM_DIR)")
    return str(tree)


@pytest.fixture(scope="module")
def mlm_stock(mlm: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``pretrain_gpt.py`` as Megatron-LM ships it: the ``mlm`` tree's, the patch reversed."""
    from megatron_mecefo.megatron_lm.patch_check import is_patched

    folder = tmp_path_factory.mktemp("megatron_lm_stock")
    script = folder / "pretrain_gpt.py"
    shutil.copy(Path(mlm) / "pretrain_gpt.py", script)
    if is_patched(str(script)):
        patch = REPO / "patches" / "megatron-lm-core_v0.16.1.patch"
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(folder))
        subprocess.run(["git", "apply", "--reverse", str(patch)], cwd=folder, check=True, env=env)
    assert not is_patched(str(script))
    return str(script)


@pytest.fixture
def busy_port() -> dict[str, str]:
    """A port held by a listening socket (in use), and a free port (nothing listens)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield {"busy_port": str(s.getsockname()[1]), "free_port": str(free_port())}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A private 3-member etcd cluster (skips where no ``etcd`` binary exists)."""
    from etcd_cluster import running_cluster

    for cluster in running_cluster(tmp_path_factory.mktemp("etcd")):
        yield {"etcd": ",".join(cluster.endpoints)}


@pytest.fixture
def live_job(etcd: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """A live job's keys on ``etcd``: a leader holding its lease (kept alive by this process,
    as a leader's supervisor does) and a durable key beside it; described in
    ``tmp_path/live_job.json`` for the row's check. Resigned afterwards."""
    from megatron_mecefo.recovery.etcd_control import EtcdControl

    job = f"live-{uuid.uuid4().hex[:8]}"
    control = EtcdControl(etcd["etcd"], f"/mecefo/{job}", 2.0)
    try:
        term = control.campaign("node0@live-job-fixture", 10.0)
        control.conn.put(control.key("kv/layout"), "live")
        (tmp_path / "live_job.json").write_text(json.dumps(
            {"endpoints": etcd["etcd"], "prefix": f"/mecefo/{job}", "leader": term.candidate}
        ))  # fmt: skip
        yield {"live_job": job}
    finally:
        if control.term is not None:
            control.resign()
        control.close()


# ---------------------------------------------------------------- the runner
def _marked(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("MECEFO_TEST_CASE") == marker:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, id=f"{r.kind}-{r.id}", marks=[pytest.mark.slow] if r.slow else [])
     for r in ROWS],
)  # fmt: skip
def test_mistake_ends_in_one_line(row: Row, tmp_path: Path, request: pytest.FixtureRequest):
    values = {"tmp": str(tmp_path)}
    for name in row.needs:
        got = request.getfixturevalue(name)
        values.update(got if isinstance(got, dict) else {name: str(got)})
    cmd = [_fill(part, values) for part in row.cmd]
    marker = uuid.uuid4().hex
    env = child_env(MECEFO_TEST_CASE=marker, **{k: _fill(v, values) for k, v in row.env.items()})
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "MECEFO_RECOVERY"):  # fmt: skip
        if key not in row.env:
            env.pop(key, None)  # a row without a launcher has none of these
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    left: list[str] = []
    try:
        if row.action is not None:
            row.action(proc, tmp_path)
        output, _ = proc.communicate(timeout=row.timeout)
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 10  # a killed rank may take a moment to be reaped
        while (alive := _marked(marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive]
    finally:
        for p in [*_marked(marker), *([psutil.Process(proc.pid)] if proc.poll() is None else [])]:
            try:
                p.kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.wait()
    prefix = _fill(row.prefix, values)
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"{len(lines)} lines start with {prefix!r}:\n{output[-4000:]}"
    # Printed once: not also by a rank beside the supervisor's line, nor by another rank.
    said = [line for line in output.splitlines() if ": error:" in line]
    if ": error:" in prefix:
        assert said == lines, f"the error is said {len(said)} times:\n" + "\n".join(said)
    else:  # a stop's last line: no error at all
        assert not said, "\n".join(said)
    for word in row.words:
        assert _fill(word, values) in lines[0], f"{word!r} not in:\n{lines[0]}"
    assert proc.returncode == row.code, f"exit {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output and "terminate called" not in output, output[-4000:]
    assert not left, f"processes left behind: {left}"
    if row.check is not None:
        row.check(output, tmp_path)
    if not row.slow:
        assert elapsed < row.startup_s, f"a start-up row took {elapsed:.1f} s"
