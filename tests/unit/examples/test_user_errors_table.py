"""The user-mistake table of docs/errors.md (``tests/helpers/user_error_rows.py``): it covers
every kind of mistake, and the page names every row. The rows run in
``tests/integration/examples/test_user_errors.py``."""

from __future__ import annotations

from conftest import REPO
from user_error_rows import ROWS


def test_rows_cover_every_kind() -> None:
    """The issue's bar: at least 40 mistakes across the six kinds, each id once."""
    kinds = {r.kind for r in ROWS}
    assert kinds == {"flags", "data", "files", "resume", "launch", "signals"}
    assert len(ROWS) >= 40 and len({r.id for r in ROWS}) == len(ROWS)


def test_errors_page_lists_every_row() -> None:
    """docs/errors.md names each row's mistake (its id), so the page and the table agree."""
    page = (REPO / "docs" / "errors.md").read_text()
    missing = [r.id for r in ROWS if f"`{r.id}`" not in page]
    assert not missing, missing
