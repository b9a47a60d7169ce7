"""MkDocs hooks for the docs site (mkdocs.yml ``hooks:``).

The pages link to repository files outside ``docs/`` with relative links, so the same links
work on GitHub: the plots under ``results/plots/`` and the READMEs of ``patches/`` and
``benchmarks/``. These hooks add those files to the site and rewrite each such link to the
copy, so ``mkdocs build --strict`` still fails on any link that points nowhere. They also
fill the API page with one entry per name of ``megatron_mecefo.__all__``.
"""

from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:  # imported where used: the API page's test reads this module without MkDocs
    from mkdocs.structure.files import Files

REPO = Path(__file__).resolve().parents[1]
# Repository files (outside docs/) that become site pages, and their place in the site.
PAGES = {"patches/README.md": "patches.md", "benchmarks/README.md": "benchmarks.md"}
PLOTS = "results/plots"
API_MARKER = "<!-- mecefo:public-api -->"
LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def _extras() -> Dict[str, str]:
    """Repository path -> site path of every file the hook adds."""
    extras = dict(PAGES)
    for png in sorted((REPO / PLOTS).glob("*.png")):
        extras[f"{PLOTS}/{png.name}"] = f"plots/{png.name}"
    return extras


def on_files(files: Files, *, config: Any) -> Files:
    """Add the plots and the two READMEs to the site."""
    from mkdocs.structure.files import File

    for repo_path, site_path in _extras().items():
        files.append(File.generated(config, site_path, abs_src_path=str(REPO / repo_path)))
    return files


def _repo_path(page: Any) -> str:
    site_to_repo = {site: repo for repo, site in _extras().items()}
    src = page.file.src_uri
    return site_to_repo.get(src, f"docs/{src}")


def _rewrite(match: re.Match, here: str, site_dir: str, extras: Dict[str, str]) -> str:
    target = match.group(2)
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return match.group(0)
    path, hash_, fragment = target.partition("#")
    if not path:
        return match.group(0)
    repo_target = posixpath.normpath(posixpath.join(posixpath.dirname(here), path))
    if repo_target.startswith("docs/"):
        site_target = repo_target[len("docs/") :]
    elif repo_target in extras:
        site_target = extras[repo_target]
    else:
        return match.group(0)  # left as written: the strict build reports it if it is broken
    new = posixpath.relpath(site_target, site_dir or ".") + hash_ + fragment
    return match.group(1) + new + match.group(3)


def _public_api() -> str:
    """One mkdocstrings entry per public name, at the module that defines it."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import megatron_mecefo  # cheap: no torch, names are loaded lazily

    lazy = getattr(megatron_mecefo, "_LAZY", {})
    lines = []
    for name in megatron_mecefo.__all__:
        if name.startswith("__"):
            continue
        if name not in lazy:
            raise RuntimeError(f"megatron_mecefo.__all__ names {name!r}, but not where it lives")
        lines += [f"::: {lazy[name]}.{name}", ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Files) -> str:
    """Point links to repository files at their copies; fill the API page."""
    extras = _extras()
    here = _repo_path(page)
    site_dir = posixpath.dirname(page.file.src_uri)
    markdown = LINK.sub(lambda m: _rewrite(m, here, site_dir, extras), markdown)
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, _public_api())
    return markdown
