"""The README and docs/*.md name only files the repository has, and the README reaches its main job early.

A newcomer follows what the docs point at: a link to a moved file, a `tests/...` or `benchmarks/...` path that was
renamed, or a design note kept outside the repository (DESIGN.md, DEVICE.md) is a dead end. Checked here, on the
text as written: markdown links (and their #anchors, against the target's headings as GitHub names them), repository
paths in the text (anything starting with one of the repository's top-level folders), and bare `NAME.md` mentions.
Paths with placeholders (`<run>`, `*`, `{a,b}`, `...`) are patterns, not files, and are left alone.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_FOLDERS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
                     and p.name not in {"build", "dist"} and not p.name.endswith(".egg-info"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./:-])((?:%s)/[\w./*<>{},|-]*[\w*}>])" % "|".join(map(re.escape, TOP_FOLDERS)))
MD_NAME = re.compile(r"(?<![\w./-])([A-Za-z][\w-]*\.md)\b")
PLACEHOLDER = set("*<>{}|")
WATCH_HEADING_BY_LINE = 80


def prose_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a fenced code block) for each line of a markdown text but the fences."""
    fenced, lines = False, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        lines.append((number, line, fenced))
    return lines


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a file's headings make (a repeated heading gets -1, -2, ... as on GitHub)."""
    counts: dict[str, int] = {}
    for _, line, fenced in prose_lines(path.read_text()):
        if not fenced and (match := re.match(r"#{1,6}\s+(.*)", line)):
            base = slug(match.group(1))
            counts[base] = counts.get(base, -1) + 1
    return {base if n == 0 else f"{base}-{n}" for base, last in counts.items() for n in range(last + 1)}


def exists(doc: Path, target: str) -> bool:
    return (doc.parent / target).exists() or (ROOT / target).exists()


def dead_references(doc: Path, text: str) -> list[str]:
    """What `text` (the contents of `doc`) names that the repository lacks, one line each, in reading order."""
    dead = []
    for number, line, fenced in prose_lines(text):
        where = f"{doc.relative_to(ROOT)}:{number}"
        if not fenced:
            for target in LINK.findall(line):
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                file, _, anchor = target.partition("#")
                linked = doc if not file else doc.parent / file
                if file and not linked.exists():
                    dead.append(f"{where}: link to {target}: no such file")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    dead.append(f"{where}: link to {target}: no heading makes #{anchor}")
            line = LINK.sub("]()", line)  # link targets are checked above, once
        for path in REPO_PATH.findall(line):
            if PLACEHOLDER.isdisjoint(path) and "/.." not in path and not exists(doc, path):
                dead.append(f"{where}: {path}: no such file or folder")
        for name in MD_NAME.findall(line):
            if not (exists(doc, name) or (ROOT / "docs" / name).exists()):
                dead.append(f"{where}: {name}: the repository has no such file")
    return dead


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_name_only_files_the_repository_has(doc):
    assert dead_references(doc, doc.read_text()) == []


def test_a_dead_link_a_renamed_path_and_an_outside_note_are_caught():
    text = ("See [the runtime](runtime.md#one-step) and [gone](gone.md), `tests/test_no_such_file.py`,\n"
            "`benchmarks/decode_step.py`, `profiles/<run>/reload-N.nsys-rep`, DESIGN.md and [x](runtime.md#nope).\n"
            "```\nan example's output may say docs/nothing.md\n```\n")
    dead = dead_references(ROOT / "docs" / "a-new-page.md", text)
    assert [line.split(": ", 1)[1] for line in dead] == [
        "link to gone.md: no such file",
        "tests/test_no_such_file.py: no such file or folder",
        "link to runtime.md#nope: no heading makes #nope",
        "DESIGN.md: the repository has no such file",
        "docs/nothing.md: no such file or folder",
    ]


def test_the_readme_reaches_tsdev_watch_early():
    """The two commands first, then the main job: a reader sees `tsdev watch` without scrolling far."""
    lines = (ROOT / "README.md").read_text().splitlines()
    headings = [n for n, line in enumerate(lines, 1) if re.match(r"#{1,3} .*`tsdev watch`", line)]
    assert headings, "README.md has no heading naming `tsdev watch`"
    assert headings[0] <= WATCH_HEADING_BY_LINE, f"README.md's `tsdev watch` heading is at line {headings[0]}"
