"""The docs are a reference that holds together: every relative link in every tracked Markdown file
resolves to a file of the repository (and a `#fragment` to a heading of that file), every `*.md` path
a page names exists, and neither the docs nor the docstrings and comments of the kit's packages and
tests narrate development history (`git log` holds it)."""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "drafter", "glm53", "kv_cache", "launcher", "seriestool", "tests")
SKIP_DIRS = {".git", ".venv", ".work", "build", "node_modules", "__pycache__"}


def tracked(pattern: str) -> list[Path]:
    """Tracked files matching a pathspec; outside a git checkout, the files on disk."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", pattern], cwd=ROOT, capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
        if names:
            return [ROOT / n for n in names if (ROOT / n).exists()]
    except (OSError, subprocess.CalledProcessError):
        pass
    suffix = pattern.lstrip("*")
    return sorted(p for p in ROOT.rglob(f"*{suffix}")
                  if not SKIP_DIRS & set(p.relative_to(ROOT).parts))


MARKDOWN = tracked("*.md")
PYTHON = [p for p in tracked("*.py") if p.relative_to(ROOT).parts[0] in PACKAGES or p.name == "apply.py"]

# ---- Markdown: links, anchors, named pages -------------------------------------------------------
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
MD_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a link inside a code block is an example)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        lines.append("" if fenced else line)
    return lines


def links_of(page: Path) -> list[str]:
    found = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        line = CODE_SPAN.sub("", line)
        found += LINK.findall(line)
        m = REF_DEF.match(line)
        if m:
            found.append(m.group(1))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def is_external(target: str) -> bool:
    return bool(re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def test_there_are_pages_to_check() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert {"README.md", "docs/ARCHITECTURE.md", "docs/GLOSSARY.md", "bench/results/README.md"} <= names


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links_of(page):
        if is_external(target):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target} (outside the repository)")
        elif not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors_of(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT).as_posix()})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_page_exists(page: Path) -> None:
    """A page named in the text (`kv_cache/DESIGN.md`, `UPSTREAM.md`) is in the repository, relative to
    the root or to the page; upstream TensorFold's own files are named with their folder in build/."""
    missing = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        for name in MD_PATH.findall(LINK.sub("", line)):  # links are the test above's
            if name.startswith("build/"):
                continue
            if not ((ROOT / name).exists() or (page.parent / name).exists()):
                missing.append(name)
    assert not missing, f"{page.relative_to(ROOT)} names pages that do not exist: {sorted(set(missing))}"


# ---- no development history --------------------------------------------------------------------
ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\w+teenth"
           r"|twentieth|twenty-\w+|\d+(?:st|nd|rd|th))")
UNIT = r"(?:ms|us|s|x|GB/s|GiB|MB)"
HISTORY = [
    (re.compile(rf"\b{ORDINAL}\s+session\b", re.I), "a numbered development session"),
    (re.compile(r"\b(?:session|round|experiment)\s*#?\d+\b", re.I), "a numbered session, round or experiment"),
    (re.compile(r"\w_exp\d*(?:_\w+)?\.(?:json|log|txt)\b", re.I), "a file named after an experiment"),
    (re.compile(r"\bpreviously\b|\bformerly\b|\bused to be\b|\bbefore/after\b|\b(?:it|this) replaced\b"
                r"|\bwhat it replaces\b|\bthe (?:earlier|previous) (?:form|kernel|code)\b|\bwhen this was written\b",
                re.I), "a before/after story"),
    (re.compile(r"\b(?:no longer|until the|since the)\b[^.\n]{0,40}\b(?:session|round|commit)\b", re.I),
     "a change narrated"),
    (re.compile(rf"\b\d[\d.,]*\s*{UNIT}?\s*(?:->|→)\s*\d[\d.,]*\s*{UNIT}(?![\w*/])"
                r"|\b\d+\.\d+\s*(?:->|→)\s*\d+\.\d+\b"), "a before -> after figure"),
]


def history_hits(text: str) -> list[str]:
    return [f"{why}: {m.group(0)!r}" for pattern, why in HISTORY for m in pattern.finditer(text)]


def docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    src = path.read_text(encoding="utf-8")
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.append((first.lineno, value.value))
    return out


def test_the_history_patterns_catch_history_and_pass_reference() -> None:
    for text in ("since the eleventh session pieces run", "the ninth session's form", "turns 1.24 -> 1.22",
                 "decode 56.5 -> 42.5 ms a token", "prefix_cache_h200_turns_exp2.json", "as round 3 showed",
                 "it previously copied", "the eleventh session's form", "the torch form it replaced",
                 "The earlier form, one GEMM", "could not be looked up when this was written"):
        assert history_hits(text), text
    for text in ("ssh session", "start_new_session=True", "a lane's HTTP session", "exp2 with ftz",
                 "`_exp2`", "stores go through it in rounds", "dict[str, int] -> bytes", "K -> 256 words",
                 "in 2048 -> out 6144", "the first round is discarded",
                 "a node replaces the siblings it dominates", "rows from the old code are never reused"):
        assert not history_hits(text), text


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_narrates_history(page: Path) -> None:
    text = "\n".join(prose_lines(page.read_text(encoding="utf-8")))
    hits = history_hits(text)
    assert not hits, f"{page.relative_to(ROOT)}: {hits} (history is `git log`; state what holds now)"


def test_no_docstring_or_comment_narrates_history() -> None:
    hits = [f"{p.relative_to(ROOT)}:{line}: {h}" for p in PYTHON for line, text in docstrings_and_comments(p)
            for h in history_hits(text)]
    assert not hits, "\n".join(hits)


def test_no_file_is_named_after_a_session_or_experiment() -> None:
    named = [p.relative_to(ROOT).as_posix() for p in tracked("*")
             if re.search(r"session|(?:^|_)exp\d*(?:_|\.|$)|(?:^|_)r\d+_|_(?:old|new|final)\.", p.name, re.I)]
    assert not named, f"rename to say what they hold: {named}"
