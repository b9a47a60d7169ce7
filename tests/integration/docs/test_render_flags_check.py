"""``scripts/render_flags.py --check`` in a fresh interpreter: it accepts the committed
docs/flags.md, and rendering the flags imports no torch."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, child_env

SCRIPT = REPO / "scripts" / "render_flags.py"


def test_check_mode_passes_without_importing_torch() -> None:
    """`render_flags.py --check` accepts the committed page, and rendering needs no torch."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(SCRIPT)!r}, '--check']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as exit_:\n"
        "    assert 'torch' not in sys.modules, 'rendering the flags imported torch'\n"
        "    sys.exit(exit_.code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
