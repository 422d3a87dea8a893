"""The README's layout tree names every module of course_lib, and nothing that is not there."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_tree(readme: str) -> set[str]:
    """Paths ("course_lib/core/train.py", "course_lib/methods/scan/") of the course_lib part of the
    README's Layout block, read from the indentation (two spaces a level)."""
    block = readme.split("## Layout\n", 1)[1].split("```", 2)[1]
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
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "course_lib").rglob("*.py") if p.name != "__init__.py"}
    folders = {p.relative_to(ROOT).as_posix() + "/" for p in (ROOT / "course_lib").rglob("*")
               if p.is_dir() and p.name != "__pycache__"}
    return files | folders | {"course_lib/"}


def test_readme_layout_matches_the_package():
    listed, present = layout_tree((ROOT / "README.md").read_text(encoding="utf-8")), package_tree()
    assert not present - listed, f"modules missing from the README's Layout: {sorted(present - listed)}"
    assert not listed - present, f"the README's Layout names what is not there: {sorted(listed - present)}"


def test_layout_reader_follows_indentation():
    readme = ("## Layout\n\n```\nnotebooks/   x\ncourse_lib/  y\n  core/  z\n    a.py  w\n  b.py  v\n"
              "tests/  t\n```\n")
    assert layout_tree(readme) == {"course_lib/", "course_lib/core/", "course_lib/core/a.py", "course_lib/b.py"}
