"""The documentation covers the package: every page is reachable and every public name documented.

The strict MkDocs build (``make docs``) catches broken links; these checks catch what it
cannot: a page left out of the navigation or the index, a public name left out of the reference
or of the overview.
"""

import re
from pathlib import Path

import mpistrat

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def pages() -> set[str]:
    return {p.name for p in DOCS.glob("*.md")}


def test_every_page_is_in_the_nav():
    nav = set(re.findall(r"^\s*-\s[^:\n]+:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert pages() - nav == set(), "pages missing from the nav in mkdocs.yml"


def test_index_links_every_page():
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", (DOCS / "index.md").read_text()))
    assert pages() - {"index.md"} - linked == set(), "pages the index does not link"


def test_every_public_name_is_in_the_api_reference():
    documented = set(re.findall(r"^::: mpistrat\.(\w+)\s*$", (DOCS / "api.md").read_text(), re.M))
    public = set(mpistrat.__all__) - {"MPI"}  # mpi4py's module, re-exported for convenience
    assert public - documented == set(), "public names missing from docs/api.md"


def test_every_public_name_is_in_the_overview():
    text = (DOCS / "overview.md").read_text()
    code = " ".join(re.findall(r"```.*?```|`[^`\n]+`", text, re.S))  # code blocks and spans
    mentioned = set(re.findall(r"\w+", code))
    assert set(mpistrat.__all__) - mentioned == set(), "public names missing from docs/overview.md"
