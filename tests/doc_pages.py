"""The documentation a user reads: README.md (the front page) and the pages of the site under docs/, where README's
sections went (mkdocs.yml). For the tests that check what the documentation says (commands, tables, figures).

    from doc_pages import doc_pages, docs_text      # tests/ is on sys.path under pytest
    docs_text()                                      # README.md and every docs page, one text

docs/BENCHMARKS.md and docs/RELIABILITY.md are links to the files at the root (benchmark scripts write those), put in
the site by the link; they are left out here, as the tests that read the documentation never read those files.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md, then every page under docs/ in path order (links to files outside docs/ left out)."""
    return [root / "README.md", *sorted(p for p in (root / "docs").rglob("*.md") if not p.is_symlink())]


def docs_text(root: Path = ROOT) -> str:
    """The text of every page of doc_pages, each headed by a line naming its file."""
    return "".join(f"\n<!-- {p.relative_to(root)} -->\n" + p.read_text() for p in doc_pages(root))
