"""The README is a front page: short, every link resolves, no dates and no words about how the
project is worked on; the docs it points to keep their links whole; docs/layout.md's tree names
every module of course_lib, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250


FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(markdown: str) -> str:
    """The text outside code blocks, code spans kept only where a link's text is one ([`x`](y))."""
    return FENCE.sub("", markdown)


def links(markdown: str) -> list[str]:
    """Every link and image target of the Markdown, code blocks left out."""
    text = prose(markdown)
    text = CODE_SPAN.sub(lambda m: m.group(0) if text[m.end():m.end() + 2] == "](" else "``", text)
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen, out = {}, set()
    for line in prose(markdown).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose file (or heading, for #anchors) is not there."""
    broken = []
    text = path.read_text(encoding="utf-8")
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved
            broken.append(f"{target} (no file {shown})")
        elif (anchor and resolved.suffix == ".md"
              and anchor not in anchors(resolved.read_text(encoding="utf-8"))):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    return broken


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_a_front_page_of_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (f"README.md has {len(lines)} lines; "
                                            "move detail into docs/")


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links {broken_links(path)}"


def test_the_readme_keeps_the_commands_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme = README.read_text(encoding="utf-8")
    for command in ('pip install -e ".[dev]"', "ruff check", "pytest"):
        assert command in ci and command in readme
    assert "python3 -m venv .venv" in ci and "python3 -m venv .venv" in readme


def test_the_checks_find_what_they_are_meant_to(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading, with `code`\n\n## Set up, open, test\n")
    page.write_text("[ok](there.md) [ok](there.md#a-heading-with-code) [ok](#own) "
                    "![pic](gone.png)\n"
                    "[bad](there.md#nowhere) [web](https://example.org/x) `[not](a-link.md)`\n"
                    "```\n[in code](nothing.md)\n```\n"
                    "# Own\n[`code` text](there.md#set-up-open-test)\n")
    assert [b.split(" ")[0] for b in broken_links(page)] == ["gone.png", "there.md#nowhere"]


# ---------------------------------------------------------------------------- docs/layout.md's tree
def layout_tree(markdown: str) -> set[str]:
    """Paths ("course_lib/core/train.py", "course_lib/methods/scan/") of the course_lib part of the
    layout's first code block, read from the indentation (two spaces a level)."""
    block = markdown.split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        name = line.split()[0] if line.strip() else ""
        depth = (len(line) - len(line.lstrip(" "))) // 2
        if depth == 0 and name != "course_lib/":
            stack = []
            continue
        if not (name.endswith("/") or name.endswith(".py")):
            continue
        stack = stack[:depth] + [name]
        if stack[0] == "course_lib/":
            paths.add("".join(stack))
    return paths


def package_tree() -> set[str]:
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "course_lib").rglob("*.py")
             if p.name != "__init__.py"}
    folders = {p.relative_to(ROOT).as_posix() + "/" for p in (ROOT / "course_lib").rglob("*")
               if p.is_dir() and p.name != "__pycache__"}
    return files | folders | {"course_lib/"}


def test_layout_matches_the_package():
    listed = layout_tree((ROOT / "docs" / "layout.md").read_text(encoding="utf-8"))
    present = package_tree()
    missing, extra = sorted(present - listed), sorted(listed - present)
    assert not missing, f"modules missing from docs/layout.md: {missing}"
    assert not extra, f"docs/layout.md names what is not there: {extra}"


def test_layout_reader_follows_indentation():
    layout = ("# Layout\n\n```\nnotebooks/   x\ncourse_lib/  y\n  core/  z\n    a.py  w\n"
              "  b.py  v\ntests/  t\n```\n")
    assert layout_tree(layout) == {"course_lib/", "course_lib/core/", "course_lib/core/a.py",
                                   "course_lib/b.py"}
