"""Whether a Megatron-LM ``pretrain_gpt.py`` carries the MeCeFO patch, said in one line.

Without the patch, Megatron-LM's parser does not know ``--mecefo`` and says only
``unrecognized arguments: --mecefo``. ``patches/run_megatron_lm_cpu.py`` checks the script
before it runs it; a launch line of one's own can check first::

    python -m megatron_mecefo.megatron_lm.patch_check /path/to/Megatron-LM && \\
        torchrun --nproc_per_node 8 /path/to/Megatron-LM/pretrain_gpt.py ... --mecefo

It exits 0 and says which script it read when the patch is there, else prints
``<program>: error: <what>; <how to apply the patch>`` and exits 2. The test is the patch's
own import line (``import megatron_mecefo.megatron_lm``); ``patches/verify_patch.py`` checks
the whole patch and trains with it. Torch-free.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import List, Optional

__all__ = ["is_patched", "missing_patch_message", "patch_for", "main"]

PATCHES = Path(__file__).resolve().parents[2] / "patches"
"""``patches/`` of a megatron-mecefo source checkout (absent from a wheel)."""


def is_patched(script: str) -> bool:
    """Whether ``script`` (a ``pretrain_gpt.py``) imports the plugin as the patches do."""
    with open(script, encoding="utf-8", errors="replace") as f:
        return "megatron_mecefo.megatron_lm" in f.read()


def patch_for(checkout: str) -> str:
    """The patch file for ``checkout`` (its tag from ``megatron/core/package_info.py``), or a
    description of the choice when the version cannot be read or has no patch."""
    info = Path(checkout) / "megatron" / "core" / "package_info.py"
    version = None
    if info.is_file():
        fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", info.read_text(), re.M))
        if len(fields) == 3:
            version = f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}"
    where = PATCHES if PATCHES.is_dir() else Path("patches")
    if version is not None and (where / f"megatron-lm-core_v{version}.patch").is_file():
        return str(where / f"megatron-lm-core_v{version}.patch")
    tags = sorted(f.name[len("megatron-lm-") : -len(".patch")] for f in where.glob("*.patch"))
    return f"{where}/megatron-lm-<tag>.patch (<tag>: your checkout's, {' or '.join(tags)})"


def missing_patch_message(script: str, flag: str = "--mecefo") -> Optional[str]:
    """The one-line error for ``flag`` given to an unpatched ``script``; None if patched."""
    if is_patched(script):
        return None
    checkout = os.path.dirname(os.path.abspath(script))
    return (
        f"{flag}: {script} does not have the MeCeFO patch (it never imports "
        "megatron_mecefo.megatron_lm), so Megatron-LM does not know the --mecefo flags; apply "
        f"it: cd {checkout} && git apply {patch_for(checkout)}"
    )


def mecefo_flag(argv: List[str]) -> Optional[str]:
    """The first ``--mecefo`` / ``--mecefo-*`` flag of ``argv``, if any."""
    for arg in argv:
        if arg == "--mecefo" or arg.startswith("--mecefo-"):
            return arg.split("=", 1)[0]
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m megatron_mecefo.megatron_lm.patch_check [CHECKOUT or pretrain_gpt.py]``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m megatron_mecefo.megatron_lm.patch_check [CHECKOUT | SCRIPT]")
        return 2
    path = args[0] if args else "."
    script = os.path.join(path, "pretrain_gpt.py") if os.path.isdir(path) else path
    prog = "megatron_mecefo.megatron_lm.patch_check"
    if not os.path.isfile(script):
        print(
            f"{prog}: error: {script}: no such file; pass a Megatron-LM checkout or its "
            "pretrain_gpt.py",
            file=sys.stderr,
        )
        return 2
    message = missing_patch_message(script)
    if message is not None:
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    print(f"{prog}: {script} has the MeCeFO patch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
