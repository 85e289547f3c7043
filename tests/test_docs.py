"""The Markdown files of the repository refer only to what the repository holds: every
relative link reaches a file (and its #anchor, for Markdown targets), every `name.md` they
mention exists, and no file names an absolute path of a machine. Fast; needs no Horovod."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"build", "dist", "node_modules"}

FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow).
INLINE_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[^)]*)?\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
# A Markdown file named in prose or in code: `docs/usage.md`, netsim.md.
MD_MENTION = re.compile(r"(?<![\w/.-])((?:\.{1,2}/|[\w-]+/)*[\w.-]+\.md)\b")
# Home directories and the work trees of particular machines, and file:// URLs.
ABSOLUTE = re.compile(
    r"(?<![\w.~$}-])(/(?:work|root|home|Users|mnt|opt|scratch)/[\w.-]+"
    r"|file://\S+|[A-Za-z]:\\\\?[\w.-]+)"
)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            if name.endswith(".md"):
                yield Path(dirpath, name)


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    seen, found = {}, set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text):
    for number, line in prose_lines(text):
        plain = CODE_SPAN.sub("", line)
        for match in INLINE_LINK.finditer(plain):
            yield number, match.group(1)
        match = REFERENCE_DEF.match(plain)
        if match:
            yield number, match.group(1)


def rel(path):
    return path.relative_to(ROOT).as_posix()


FILES = list(markdown_files())


def test_there_are_markdown_files():
    assert any(rel(p) == "README.md" for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=rel)
def test_relative_links_resolve(path):
    dead = []
    for number, target in links(path.read_text(encoding="utf-8")):
        if EXTERNAL.match(target):
            continue
        if target.startswith("/"):
            dead.append(f"{rel(path)}:{number}: {target} (absolute link)")
            continue
        name, _, anchor = target.partition("#")
        file = (path.parent / name).resolve() if name else path
        if not file.exists():
            dead.append(f"{rel(path)}:{number}: {target} (no such file)")
        elif ROOT not in file.parents and file != ROOT:
            dead.append(f"{rel(path)}:{number}: {target} (outside the repository)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(f"{rel(path)}:{number}: {target} (no heading #{anchor})")
    assert not dead, "dead links:\n" + "\n".join(dead)


@pytest.mark.parametrize("path", FILES, ids=rel)
def test_mentioned_markdown_files_exist(path):
    names = {p.name for p in FILES}
    missing = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for mention in MD_MENTION.findall(re.sub(r"\w+://\S+", "", line)):
            here = (path.parent / mention).resolve()
            if here.exists() or (ROOT / mention).exists():
                continue
            if "/" not in mention and mention in names:
                continue
            missing.append(f"{rel(path)}:{number}: {mention}")
    assert not missing, "Markdown files that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("path", FILES, ids=rel)
def test_no_absolute_paths_of_a_machine(path):
    found = [
        f"{rel(path)}:{number}: {match}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in ABSOLUTE.findall(line)
    ]
    assert not found, "absolute paths:\n" + "\n".join(found)


def test_the_checks_catch_what_they_are_for(tmp_path):
    assert (
        slug("Options of `DistributedOptimizer` (PyTorch)")
        == "options-of-distributedoptimizer-pytorch"
    )
    text = "[a](docs/nowhere.md) `[b](ignored.md)`\n```\n[c](also-ignored.md)\n```\n"
    assert [t for _, t in links(text)] == ["docs/nowhere.md"]
    assert MD_MENTION.findall("see architecture.md and `docs/usage.md`.") == [
        "architecture.md",
        "docs/usage.md",
    ]
    assert ABSOLUTE.findall("in /work/main/x and /root/.cache, not /usr/local/cuda") == [
        "/work/main",
        "/root/.cache",
    ]
