"""``patches/verify_patch.py`` on a checkout it cannot fully check here (issue 12, item 12): an
already patched core_v0.19.0 checkout passes (the README's order: apply, then verify), and a
checkout the patch does not fit is named."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from conftest import child_env


def _preimage_checkout(root: Any, tag: str, patched: bool) -> str:
    """A folder whose pretrain_gpt.py is made of the patch's own context and removed lines
    (what ``git apply`` matches), optionally with the patch applied."""
    import subprocess

    from conftest import REPO

    patch = REPO / "patches" / f"megatron-lm-{tag}.patch"
    lines = []
    for line in patch.read_text().splitlines()[4:]:
        if line.startswith("@@"):
            continue
        if line[:1] in (" ", "-"):
            lines.append(line[1:])
    checkout = root / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("\n".join(lines) + "\n")
    if patched:
        subprocess.run(["git", "apply", str(patch)], cwd=checkout, check=True)
    return str(checkout)


@pytest.mark.parametrize("patched", [False, True])
def test_verify_patch_on_an_already_patched_checkout(tmp_path: Any, patched: bool) -> None:
    """Item 12: the README's order (apply, then verify) used to fail with 'does not apply'.
    The 0.19 tag stops after the patch check here (megatron-core 0.16 installed)."""
    import subprocess

    from conftest import REPO

    checkout = _preimage_checkout(tmp_path, "core_v0.19.0", patched)
    env = child_env(TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(REPO / "patches" / "verify_patch.py"), checkout, "--tag",
         "core_v0.19.0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = "is already applied" if patched else "git apply --check"
    assert expected in proc.stdout and "NOT RUN" in proc.stdout
    assert not list(tmp_path.glob("mecefo_verify_*"))  # nothing left behind


def test_verify_patch_names_a_checkout_it_cannot_patch(tmp_path: Any) -> None:
    import subprocess

    from conftest import REPO

    checkout = tmp_path / "other"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("print('something else')\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "patches" / "verify_patch.py"), str(checkout), "--tag",
         "core_v0.16.1"],
        env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "is not applied there either" in proc.stderr
