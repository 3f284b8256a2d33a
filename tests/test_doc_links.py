"""The documentation's links lead somewhere: every relative link (and image) of README.md, docs/*.md and the
pages of benchmarks/results/ names a file or folder that exists, and so does every path under
benchmarks/results/ that they name in prose; benchmarks/results/README.md indexes every result set."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *RESULTS.rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title"), ![alt](…)
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)  # [name]: target
# A path in prose (a code span, a command's --out): from the repository's root, not after another path part.
MENTION = re.compile(r"(?<![\w./-])benchmarks/results(?:/[\w.{},-]+)*/?")


def prose(text: str) -> str:
    """The text without fenced code blocks and with inline code spans emptied (a link's text may be one)."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "``", text)


def relative_links(page: Path) -> list[str]:
    text = prose(page.read_text(encoding="utf-8"))
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


def expanded(path: str) -> list[str]:
    """`a/b.{json,md}` as a/b.json and a/b.md."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for part in m.group(1).split(",") for p in expanded(path[: m.start()] + part + path[m.end():])]


def test_the_pages_are_found():
    assert ROOT / "README.md" in PAGES and RESULTS / "README.md" in PAGES and len(PAGES) > 60


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_lead_to_files(page):
    missing = [t for t in relative_links(page) if not (page.parent / unquote(t.split("#")[0])).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_named_result_paths_exist(page):
    named = {p.rstrip(".,;:") for p in MENTION.findall(page.read_text(encoding="utf-8"))}
    missing = sorted(p for n in named for p in expanded(n) if not (ROOT / p).exists())
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_results_index_lists_every_result_set():
    listed = {(RESULTS / t).resolve() for t in relative_links(RESULTS / "README.md")}
    sets = {p.resolve() for p in RESULTS.rglob("*.md") if p != RESULTS / "README.md"}
    assert sets and not sets - listed, f"not in benchmarks/results/README.md: {sorted(sets - listed)}"
    assert all(p.parent.parent == RESULTS for p in sets), "a result set belongs in its study's folder"
