"""bench/results holds the measurements the docs publish, indexed by one summary page: every relative
link there resolves, every file there is linked from it (or from a decision record in docs/decisions/), and no file
is named after the work that produced it rather than what it measures."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SUMMARY = RESULTS / "README.md"
DECISIONS = sorted((ROOT / "docs" / "decisions").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_every_relative_link_in_the_summary_resolves() -> None:
    links = relative_links(SUMMARY)
    assert links, "the summary links its JSON"
    broken = [t for t in links if not (SUMMARY.parent / t.split("#")[0]).exists()]
    assert not broken, f"bench/results/README.md links to missing files: {broken}"


def test_every_relative_link_in_the_decision_records_resolves() -> None:
    broken = [f"{page.name}: {t}" for page in DECISIONS for t in relative_links(page)
              if not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"docs/decisions/ links to missing files: {broken}"


def test_every_result_file_is_linked_from_the_summary_or_a_decision() -> None:
    linked = {(page.parent / t).resolve() for page in (SUMMARY, *DECISIONS) for t in relative_links(page)}
    orphans = sorted(p.name for p in RESULTS.iterdir() if p != SUMMARY and p.resolve() not in linked)
    assert not orphans, f"files nothing publishes (git rm them, or link them from the summary): {orphans}"


def test_result_files_are_named_after_what_they_measure() -> None:
    history = re.compile(r"session|(^|_)r\d+_|before|after|_old|_new|_final|_first|_ab_")
    named = sorted(p.name for p in RESULTS.iterdir() if history.search(p.name))
    assert not named, f"rename to say what they measure: {named}"
