"""The documentation site (mkdocs.yml, docs/) builds in strict mode, and strict mode catches what it should.

    .venv/bin/python -m pytest tests/test_docs_site.py -q          # needs the docs extra: pip install -e '.[docs]'

The first test builds the repository's site as `make docs` does (`mkdocs build --strict`, into a temporary
directory) and checks that every page of the navigation was written. The others copy docs/ and mkdocs.yml into a
temporary directory, plant one fault each (a link to a page that does not exist, a page left out of the navigation,
a docstring reference to an object that does not exist) and check that the strict build fails naming it, so a
configuration that stopped validating would fail here. Also: README.md stays a front page (at most 300 lines) that
links every guide, and scripts/overoptimisation.py writes its table into the page that holds its block.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify  # mkdocs' heading ids (its default slugify)

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300  # issue 49: the front page says what difrl is and points to the pages


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config` into `site` (what `make docs` runs); nothing is fetched."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner, not a warning
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, env=env, timeout=300)


def _nav_pages(nav) -> list[str]:
    """The markdown files the navigation lists, in order."""
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _config() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _copy(tmp_path: Path) -> Path:
    """docs/ (links followed: BENCHMARKS.md and RELIABILITY.md become files) and mkdocs.yml in tmp_path, with the API
    reference still read from this repository's difrl; returns the copied mkdocs.yml."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs", symlinks=False)
    text = (ROOT / "mkdocs.yml").read_text()
    assert "paths: [.]" in text, "mkdocs.yml's python handler is expected to read the package from the root"
    (tmp_path / "mkdocs.yml").write_text(text.replace("paths: [.]", f"paths: [{ROOT}, {tmp_path}]"))
    return tmp_path / "mkdocs.yml"


def _add_to_nav(config: Path, title: str, page: str) -> None:
    cfg = yaml.safe_load(config.read_text())
    cfg["nav"].append({title: page})
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _fails_naming(proc: subprocess.CompletedProcess, *words: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the strict build passed with a planted fault:\n{out[-3000:]}"
    assert "strict mode" in out, out[-3000:]
    for w in words:
        assert w in out, f"the build's warnings do not name {w!r}:\n{out[-3000:]}"


# ---------------------------------------------------------------------------------- the repository's site


def test_the_site_builds_in_strict_mode_with_every_page_of_the_navigation(tmp_path):
    assert importlib.util.find_spec("mkdocs") and importlib.util.find_spec("mkdocstrings_handlers"), \
        "the docs extra is not installed: pip install -e '.[docs]' (make test installs it)"
    cfg = _config()
    assert cfg.get("strict") is True
    proc = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    pages = _nav_pages(cfg["nav"])
    on_disk = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(pages) == on_disk, (f"every page under docs/ is in mkdocs.yml's nav once, and only those: not in the "
                                      f"nav {sorted(set(on_disk) - set(pages))}, not on disk {sorted(set(pages) - set(on_disk))}")
    for page in pages:
        html = tmp_path / "site" / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert html.is_file(), f"{page} was not built ({html})"
    # the API reference is rendered from the docstrings, not left as `::: module` text
    rollout = (tmp_path / "site" / "reference" / "rollout" / "index.html").read_text()
    assert "difrl.rollout.regenerate" in rollout and ":::" not in rollout
    # nothing is fetched when a page is read: no web fonts, no analytics, no scripts from elsewhere
    for html in (tmp_path / "site").rglob("*.html"):
        text = html.read_text()
        assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?://", text), f"{html} loads a remote resource"
        assert "fonts.googleapis" not in text and "googletagmanager" not in text, html


def test_a_link_to_a_missing_page_fails_the_strict_build(tmp_path):
    config = _copy(tmp_path)
    page = tmp_path / "docs" / "guides" / "rewards.md"
    page.write_text(page.read_text() + "\nSee [the planted page](nowhere-planted.md).\n")
    _fails_naming(_mkdocs(config, tmp_path / "site"), "nowhere-planted.md")


def test_a_link_to_a_missing_anchor_fails_the_strict_build(tmp_path):
    config = _copy(tmp_path)
    page = tmp_path / "docs" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [a section](concepts.md#no-such-section-planted).\n")
    _fails_naming(_mkdocs(config, tmp_path / "site"), "no-such-section-planted")


def test_a_page_missing_from_the_navigation_fails_the_strict_build(tmp_path):
    config = _copy(tmp_path)
    (tmp_path / "docs" / "guides" / "orphan-planted.md").write_text("# An orphan\n\nIn no navigation.\n")
    _fails_naming(_mkdocs(config, tmp_path / "site"), "orphan-planted.md")


def test_a_docstring_reference_to_a_missing_object_fails_the_strict_build(tmp_path):
    config = _copy(tmp_path)
    (tmp_path / "planted_module.py").write_text('"""A planted module.\n\nIts docstring cross-references '
                                                '[a missing object][difrl.rollout.no_such_function_planted]."""\n')
    (tmp_path / "docs" / "reference" / "planted.md").write_text("# Planted\n\n::: planted_module\n")
    _add_to_nav(config, "Planted", "reference/planted.md")
    _fails_naming(_mkdocs(config, tmp_path / "site"), "difrl.rollout.no_such_function_planted")


# ---------------------------------------------------------------------------------- the front page


def test_readme_is_a_front_page_that_links_every_guide():
    readme = (ROOT / "README.md").read_text()
    n = len(readme.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the front page keeps at most {README_MAX_LINES}"
    links = set(re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", readme))
    pages = {target for target, _ in links}
    guides = {f"docs/{p}" for p in _nav_pages(_config()["nav"]) if p.startswith(("guides/", "quickstart", "concepts"))}
    assert guides <= pages, f"README.md's map of the guides lacks {sorted(guides - pages)}"
    for target, anchor in links:  # README is not part of the site's build: its links into the pages are checked here
        assert (ROOT / target).is_file(), f"README.md links {target}, which does not exist"
        if anchor:
            prose = re.sub(r"^```.*?^```", "", (ROOT / target).read_text(), flags=re.M | re.S)
            ids = {slugify(h.replace("`", ""), "-") for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}
            assert anchor in ids, f"README.md links {target}#{anchor}: no such heading"


# ---------------------------------------------------------------------------------- generated blocks in the pages


def _overoptimisation():
    spec = importlib.util.spec_from_file_location("overoptimisation", ROOT / "scripts" / "overoptimisation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_overoptimisation_script_writes_its_table_into_the_page_that_holds_it(tmp_path):
    oo = _overoptimisation()
    assert oo.PAGE == ROOT / "docs" / "guides" / "methods.md"
    text = oo.PAGE.read_text()
    assert text.count(oo.BEGIN) == 1 and text.count(oo.END) == 1, f"{oo.PAGE} holds the over-optimisation block once"
    page = tmp_path / "methods.md"
    page.write_text(text)
    table = "\n".join([oo.BEGIN, "`python scripts/overoptimisation.py` (planted)", "", "| 0 | 1 |", oo.END])
    oo.write_table(page, table)
    head, rest = text.split(oo.BEGIN, 1)
    assert page.read_text() == head + table + rest.split(oo.END, 1)[1]  # the block replaced, the rest as it was
    (tmp_path / "README.md").write_text("# no block here\n")
    with pytest.raises(ValueError, match="must hold one <!-- overopt:start -->"):
        oo.write_table(tmp_path / "README.md", table)
