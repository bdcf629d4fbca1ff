#!/usr/bin/env python3
"""Checks the relative links of the project's Markdown: every linked file or
directory exists inside the repository, and every `#anchor` names a heading
(or an explicit `<a id>`) of the Markdown file it points into.

    scripts/check_links.py [FILE.md ...]

Without arguments it checks README.md, docs/*.md, the READMEs of bench/,
sim/ and envoy/, and bench-results/*.md (its index and notes). External links (http:, https:, mailto:)
are not fetched. Links inside code spans and fenced code blocks are not
links. Anchors follow GitHub's rule for heading ids (see `slug`). Prints one
line per broken link and exits 1 if there is any.
"""

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = [
    "README.md",
    "docs/*.md",
    "bench/README.md",
    "sim/README.md",
    "envoy/README.md",
    "bench-results/*.md",
]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
CODE_SPAN = re.compile(r"(`+)((?:[^`\n]|\n(?!\s*\n)|(?!\1)`+)+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of
# brackets (an image inside a link).
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+[\"'(][^)]*)?\s*\)"
)
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*?\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def slug(heading):
    """GitHub's id for a heading: the text without its inline markup,
    lowercased, every character that is not a letter, mark, digit, space,
    hyphen or connector (the underscore) dropped, each space turned into a
    hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|\*)(?=\S)(.+?)(?<=\S)\1", r"\2", text)  # emphasis
    text = re.sub(r"(?<!\w)(__|_)(?=\S)(.+?)(?<=\S)\1(?!\w)", r"\2", text)
    out = []
    for ch in text.strip().lower():
        if ch == " ":
            out.append("-")
        elif ch == "-" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc":
            out.append(ch)
    return "".join(out)


def outside_code(text):
    """The text with fenced code blocks and code spans blanked out (line
    breaks kept, so positions map to the same line numbers). A code span may
    continue on the next line, as in Markdown, but not across a blank line."""
    kept = []
    fence = None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            kept.append("")
            continue
        if m:
            fence = m.group(1)
            kept.append("")
            continue
        kept.append(line)
    return CODE_SPAN.sub(lambda s: re.sub(r"[^\n]", " ", s.group(0)), "\n".join(kept))


def anchors(text):
    """Every anchor a Markdown text defines: heading ids (a repeated id gets
    -1, -2, ...) and explicit <a id> / <a name> anchors."""
    seen = {}
    out = set()
    fence = None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        h = HEADING.match(line)
        if h:
            base = slug(h.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(HTML_ANCHOR.findall(line))
    return out


def links(text):
    """(line number, target) for every link and image of a Markdown text,
    including links whose text runs over several lines."""
    masked = outside_code(text)
    found = [(m.start(1), m.group(1)) for m in INLINE_LINK.finditer(masked)]
    offset = 0
    for line in masked.split("\n"):
        m = REFERENCE_DEF.match(line)
        if m:
            found.append((offset + m.start(1), m.group(1)))
        offset += len(line) + 1
    return [(masked.count("\n", 0, pos) + 1, target) for pos, target in sorted(found)]


def check_file(path, root=ROOT, anchor_cache=None):
    """Problems with the links of one Markdown file, as 'file:line: what'."""
    anchor_cache = {} if anchor_cache is None else anchor_cache
    root = root.resolve()
    path = path.resolve()
    rel = path.relative_to(root)
    text = path.read_text(encoding="utf-8")
    problems = []

    def anchors_of(target):
        if target not in anchor_cache:
            anchor_cache[target] = anchors(target.read_text(encoding="utf-8"))
        return anchor_cache[target]

    for number, raw in links(text):
        target = raw[1:-1] if raw.startswith("<") and raw.endswith(">") else raw
        where = f"{rel}:{number}"
        if not target:
            problems.append(f"{where}: empty link")
            continue
        if SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, fragment = target.partition("#")
        file_part = unquote(file_part.split("?", 1)[0])
        if file_part.startswith("/"):
            problems.append(f"{where}: {target}: absolute path (link relative to the file instead)")
            continue
        dest = (path.parent / file_part).resolve() if file_part else path
        if dest != root and root not in dest.parents:
            problems.append(f"{where}: {target}: points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: {target}: no such file or directory")
            continue
        if fragment and dest.is_file() and dest.suffix.lower() == ".md":
            if unquote(fragment) not in anchors_of(dest):
                problems.append(f"{where}: {target}: no heading or anchor #{fragment} in {dest.relative_to(root)}")
    return problems


def default_files(root=ROOT):
    out = []
    for pattern in DEFAULT_FILES:
        matches = sorted(root.glob(pattern))
        if not matches and "*" not in pattern:
            matches = [root / pattern]
        out += matches
    return out


def check(files, root=ROOT):
    """Problems with the links of the given Markdown files."""
    problems = []
    cache = {}
    for f in files:
        if f.is_file():
            problems += check_file(f, root, cache)
        else:
            shown = f.resolve().relative_to(root.resolve()) if root.resolve() in f.resolve().parents else f
            problems.append(f"{shown}: file to check does not exist")
    return problems


def main(argv):
    files = [Path(a) for a in argv[1:]] or default_files()
    problems = check(files)
    checked = sum(1 for f in files if f.is_file())
    for p in problems:
        print(p)
    if problems:
        print(f"check-links: {len(problems)} broken link(s) in {checked} file(s)")
        return 1
    print(f"check-links: every relative link and anchor resolves ({checked} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
