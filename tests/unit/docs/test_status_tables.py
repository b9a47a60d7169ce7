"""The status table lives in one place, the docs site's home page (docs/index.md); the README's
first screen says what runs where and links to it (issue 45)."""

from __future__ import annotations

from conftest import REPO


def _status_rows(text: str) -> list[str]:
    if "## Status" not in text:
        return []
    after = text[text.index("## Status") :].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("|"))
    rows = []
    for line in after[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_status_table_is_on_the_home_page_only() -> None:
    """docs/index.md has the table; the README has none and links to it instead."""
    readme = (REPO / "README.md").read_text()
    home = _status_rows((REPO / "docs" / "index.md").read_text())
    assert len(home) > 3, home
    assert _status_rows(readme) == [], "README.md repeats the status table: link to it"
    assert "docs/index.md#status" in readme


def test_readme_first_screen_names_versions_gpu_status_limits_and_quick_start() -> None:
    """The first 30 lines: the tested tag and backend, what has not run, the refused flags and
    the quick start from a git clone."""
    first = "\n".join((REPO / "README.md").read_text().splitlines()[:30])
    for words in (
        "core_v0.16.1",
        "gloo",
        "NCCL",
        "Transformer Engine",
        "--num-experts",
        "--rampup-batch-size",
        "--dataloader-type cyclic",
        "--context-parallel-size",
        "git clone",
        "make demo",
    ):
        assert words in first, words
