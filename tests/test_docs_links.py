"""Every relative link in README.md, docs/ and notes/ leads to a file that exists, and an anchor to a heading of it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notes").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ +(.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def _relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_links_into_every_docs_page():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _relative_links(ROOT / "README.md")}
    assert not [page.name for page in sorted((ROOT / "docs").glob("*.md")) if page.resolve() not in linked]


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [gone](missing.md) [bad anchor](page.md#nothing)\n```\n[in code](x.md)\n```\n")
    assert _relative_links(page) == ["page.md#title", "missing.md", "page.md#nothing"]
    assert _anchors(page) == {"title"}


# Files the README and docs/ name in backticks (`autodeploy/runtime/engine.py`): a file that moves or goes must
# take its mentions along.
NAMED_PATH = re.compile(r"`((?:autodeploy|transforms|patterns|custom_ops|autotuner|configs|scripts|tests|notes|docs|requirements)/[^`\s*…]*)`")


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(page):
    named = {path.rstrip("/") for path in NAMED_PATH.findall(page.read_text())}
    assert not [path for path in sorted(named) if not (ROOT / path).exists()]
