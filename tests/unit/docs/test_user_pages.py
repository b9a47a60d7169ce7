"""The user pages carry no lab notebook: no issue numbers, commit hashes, "the shared notes",
numbered stops or former values ("(was 5.58 s)"). Those belong on the developers' page
(docs/development.md), which this test leaves alone. The user pages: every page of docs/ but
development.md, the README and the two repository READMEs the site shows (patches/,
benchmarks/)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Tuple

import pytest
from conftest import REPO

DEVELOPERS = "docs/development.md"
USER_PAGES = sorted(
    [str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")]
    + ["README.md", "patches/README.md", "benchmarks/README.md"]
)
USER_PAGES.remove(DEVELOPERS)

# What a lab notebook leaves behind on a page, each with the reason it is not for users.
NOTEBOOK = {
    "an issue number": re.compile(r"\bissues?\s+#?\d+|\bissues?\s+\(?#", re.I),
    "an issue reference": re.compile(r"(?<![\w/&])#\d{2,}(?![\w-])"),
    # Hex of 7 to 40 characters with a letter and a digit: a commit hash. A 64-digit sha256
    # is longer, and 0x addresses have no word boundary after the x.
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "the shared notes": re.compile(r"\bshared notes\b", re.I),
    "a numbered stop": re.compile(r"\bstops? \d+\b", re.I),
    "a former value": re.compile(r"\((?:was|before:?|previously) [−-]?\d", re.I),
}

# What looks like it but is not: citations of other projects' trackers, and the checksums the
# recovery summary prints in a quoted log line.
ALLOWED = [
    re.compile(r"\b(?:torchft|[\w.-]+/[\w.-]+ PR) #\d+"),
    re.compile(r"\bpytorch issue \d+", re.I),
    re.compile(r"\(checksum [0-9a-f]{16}\)"),
]


def notebook_lines(text: str) -> List[Tuple[int, str, str]]:
    """(line number, what, line) for every lab-notebook trace in ``text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        clean = line
        for allowed in ALLOWED:
            clean = allowed.sub(" ", clean)
        for what, pattern in NOTEBOOK.items():
            if pattern.search(clean):
                hits.append((number, what, line.strip()[:120]))
    return hits


@pytest.mark.parametrize("page", USER_PAGES)
def test_user_page_has_no_lab_notebook(page: str) -> None:
    """No issue number, commit hash, shared-notes reference, numbered stop or former value."""
    hits = notebook_lines((REPO / page).read_text())
    assert not hits, f"{page}: move these to {DEVELOPERS} or drop them: {hits}"


@pytest.mark.parametrize(
    "text",
    [
        "as issue 43 asked",
        "(issues 44 and 46)",
        "fixed in #52",
        "on the background worker since 646b823",
        "at commit 1f0c2d9e8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e",
        "the shared notes had measured it",
        "Stop 12 measured 3 s",
        "heal 0.93 s (was 5.58 s)",
    ],
)
def test_the_patterns_catch_the_notebook(text: str) -> None:
    """Each kind of trace is caught (a pattern that matched nothing would pass every page)."""
    assert notebook_lines(text), text


@pytest.mark.parametrize(
    "text",
    [
        "torchft #329; NVIDIA-NeMo/RL PR #3186; pytorch issue 135712",
        "replica (checksum 87ded54f0bde8f39)",
        "[gaps](convergence.md#32-replicas-one-micro-batch-per-replica)",
        "sha256:" + "ab12" * 16,
        "an address 0x7f3a2b1c9d00",
        "lr 3e-3, 1.5e-05, fp32, 1234567 samples, deadbeef",
    ],
)
def test_the_patterns_spare_what_is_not_notebook(text: str) -> None:
    """Citations of other projects, quoted checksums, anchors, digests, addresses, numbers."""
    assert not notebook_lines(text), notebook_lines(text)


def test_every_user_page_is_checked() -> None:
    """The list covers the site's pages (all of docs/ but the developers' page)."""
    assert len(USER_PAGES) >= 25 and Path(DEVELOPERS).name not in {
        Path(p).name for p in USER_PAGES if p.startswith("docs/")
    }


GPU_STATUS = (
    "GPU status: the techniques' cost benchmark and the fail-slow device clock ran on one NVIDIA"
    " H200 (bf16); the recovery path, NCCL, Transformer Engine and multi-GPU training have not"
    " run on a GPU."
)


@pytest.mark.parametrize(
    "page",
    ["README.md", "docs/index.md", "docs/results.md", "docs/install-gpu.md", "docs/stragglers.md"],
)
def test_every_status_page_states_the_same_gpu_status(page: str) -> None:
    """One GPU status, word for word (bold and line breaks aside), on every page that says what
    ran where; none of them says that nothing ran on a GPU."""
    text = " ".join((REPO / page).read_text().replace("*", "").split())
    assert GPU_STATUS in text, page
    assert not re.search(r"nothing (in this project )?has run on a GPU", text, re.I), page


def test_results_page_is_at_most_200_lines() -> None:
    """The results page leads with the answer; the detail lives on its own pages."""
    lines = len((REPO / "docs" / "results.md").read_text().splitlines())
    assert lines <= 200, lines
