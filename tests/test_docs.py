"""The user guide's links resolve: every relative link of README.md and docs/*.md names a file of
the repository, and every ``#anchor`` names a heading of its page (GitHub's heading ids) (no Ray, no server)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`]*`")


def heading_id(title: str) -> str:
    """GitHub's id of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    """The ids of a page's headings (a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    ids = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match is None:
            continue
        base = heading_id(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        ids.add(base if count == 0 else f"{base}-{count}")
    return ids


def broken_links(page: pathlib.Path) -> list[str]:
    """The relative links of ``page`` whose file or anchor does not exist."""
    broken = []
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL: not checked here
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no file {path})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_resolves(page):
    assert broken_links(page) == []


def test_heading_ids_follow_github():
    assert heading_id("Adaptive block length (`gamma: \"auto\"`, `verifiers/adaptive.py`)") == (
        "adaptive-block-length-gamma-auto-verifiersadaptivepy")
    assert heading_id("Request: `speculation`") == "request-speculation"
    assert heading_id("Placement: which models share a worker") == "placement-which-models-share-a-worker"


def test_a_broken_anchor_is_caught(tmp_path):
    # Negative control: a link to a missing heading and one to a missing file are both reported.
    (tmp_path / "a.md").write_text("# A\n\n## Real heading\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#real-heading) [bad](a.md#no-such) [gone](c.md) [self](#b)\n", encoding="utf-8")
    page.write_text(page.read_text(encoding="utf-8") + "\n# B\n", encoding="utf-8")
    assert broken_links(page) == ["a.md#no-such (no heading #no-such in a.md)", "c.md (no file c.md)"]



# One source for every figure: measured figures and the commits that measured them live only in the
# generated docs/results.md (its provenance lines); prose cites its tables.
GENERATED_RESULTS = ROOT / "docs" / "results.md"
PROSE = [page for page in PAGES if page != GENERATED_RESULTS] + sorted((ROOT / "deploy").glob("*.yaml"))
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
MEASURED_FIGURE = re.compile(r"\b\d[\d,]*(\.\d+)?(x\b| ?(tok/s|tokens/s|tokens a second)\b)")
DOCS_BUDGET_BYTES = 100_000


def restated(page: pathlib.Path, pattern: re.Pattern[str]) -> list[str]:
    """``page:line: match`` for every match of ``pattern`` in ``page``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    return [f"{page.name}:{i}: {m.group(0)}" for i, line in enumerate(lines, 1) for m in pattern.finditer(line)]


@pytest.mark.parametrize("page", PROSE, ids=lambda page: page.name)
def test_no_commit_hash_or_measured_figure_outside_the_generated_results(page):
    assert restated(page, COMMIT_HASH) == [], "commits belong in docs/results.md's provenance lines"
    assert restated(page, MEASURED_FIGURE) == [], "measured figures belong in docs/results.md: cite its table"


def test_the_figure_rules_catch_what_they_name(tmp_path):
    # Negative control: a hash, a ratio and a throughput are caught; decimals, sizes and shapes are not.
    page = tmp_path / "p.md"
    page.write_text("at 8062876 (a1e8f8e) sd is 1.45x ar, 433.6 tok/s, 1,218 tokens/s\n"
                    "1000000 bytes, 2 x 16 + 4 slots, --shapes 1x1,16x1, 40 ms modelled, 0xff\n", encoding="utf-8")
    assert [hit.split(": ", 1)[1] for hit in restated(page, COMMIT_HASH)] == ["a1e8f8e"]
    assert [hit.split(": ", 1)[1] for hit in restated(page, MEASURED_FIGURE)] == ["1.45x", "433.6 tok/s", "1,218 tokens/s"]


def test_docs_fit_their_budget():
    sizes = {page.name: page.stat().st_size for page in (ROOT / "docs").iterdir() if page.is_file()}
    assert sum(sizes.values()) < DOCS_BUDGET_BYTES, f"docs/ holds {sum(sizes.values()):,} bytes: {sorted(sizes.items())}"
