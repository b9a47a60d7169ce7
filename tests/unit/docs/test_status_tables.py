"""The README's status table and the docs site's home page (docs/index.md) say the same: one
row per capability, the same words, links rewritten from ``docs/x.md`` to ``x.md``."""

from __future__ import annotations

from conftest import REPO


def _status_rows(text: str) -> list[str]:
    after = text[text.index("## Status") :].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("|"))
    rows = []
    for line in after[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_readme_and_docs_home_status_tables_agree() -> None:
    readme = _status_rows((REPO / "README.md").read_text())
    home = _status_rows((REPO / "docs" / "index.md").read_text())
    assert len(readme) > 3, readme
    assert [row.replace("](docs/", "](") for row in readme] == home, (
        "README.md's status table and docs/index.md's differ: edit both (README links point "
        "into docs/, the home page's are relative to it)"
    )
