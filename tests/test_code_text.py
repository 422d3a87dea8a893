"""course_lib's comments and docstrings say what a thing is and why: dates, run tables and words
about how the project is worked on belong in docs/tuning_notes.md (the lab log), not in the code."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "course_lib"

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")  # an ISO date, anywhere in the file
PROCESS = re.compile(r"\b(stops?|issue|round) #?\d+\b|\blent (GPU|H\d+|A\d+|machine)\b"
                     r"|\bborrowed\b",
                     re.IGNORECASE)  # working rounds, tracker numbers, loaned machines
# A markdown table row: the stripped text starts with "| " (or "|-", "|:") and has two more "|";
# not a norm such as "||x|| < eps" or "|a|^2".
TABLE_ROW = re.compile(r"^\|[ :-](?:[^|]*\|){2}")


def _text_lines(source: str) -> dict[int, str]:
    """{line number: text} of the comments (without the "#") and of the lines of the docstrings
    (every string standing alone as a statement) in `source`."""
    lines, found = source.splitlines(), {}
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            for number in range(node.lineno, node.end_lineno + 1):
                found[number] = lines[number - 1]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string[1:]
    return found


def problems(source: str, name: str = "<string>") -> list[str]:
    """'name:line: what' for every ISO date or process word in `source` and every markdown table
    row in its comments and docstrings."""
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        for pattern, what in ((DATE, "a date"),
                              (PROCESS, "words about how the project is worked on")):
            match = pattern.search(line)
            if match:
                found.append(f"{name}:{number}: {what} ({match.group(0)!r}): "
                             "move it to docs/tuning_notes.md")
    for number, text in sorted(_text_lines(source).items()):
        if TABLE_ROW.match(text.strip()):
            found.append(f"{name}:{number}: a table row in a comment or docstring: move it to "
                         "docs/tuning_notes.md")
    return sorted(found, key=lambda p: int(p.split(":")[1]))


def test_the_checker_finds_what_it_looks_for():
    planted = '''"""A module.

| run | R@1 |
"""
import torch  # measured 2026-11-26 on a lent GPU, stop 3


def f(x):
    #  | 64 | 35.9 |
    return round(x, 2) | 1  # issue 12
'''
    assert [p.split(":", 2)[1:] for p in problems(planted)] == [
        ["3", " a table row in a comment or docstring: move it to docs/tuning_notes.md"],
        ["5", " a date ('2026-11-26'): move it to docs/tuning_notes.md"],
        ["5",
         " words about how the project is worked on ('lent GPU'): move it to docs/tuning_notes.md"],
        ["9", " a table row in a comment or docstring: move it to docs/tuning_notes.md"],
        ["10",
         " words about how the project is worked on ('issue 12'): move it to docs/tuning_notes.md"],
    ]


@pytest.mark.parametrize("legitimate", [
    'x = (a\n     | b)\n',  # a bitwise or at the start of a continued line is code
    'rows = ["| method | R@1 |", "|---|---|"]\n',  # a markdown table the code writes
    'y = round(x, 2)\nstop = 3\nissue = "none"\n',
    '# ||x|| < eps, and |a|^2 = sum_c w_c (c . c)\n',  # norms in a comment
    '"""Stops after max_steps rounds of 10 steps; see the issue tracker."""\n',
])
def test_the_checker_lets_code_through(legitimate):
    assert problems(legitimate) == []


def test_course_lib_has_no_dates_run_tables_or_process_words():
    found = [p for path in sorted(ROOT.rglob("*.py"))
             for p in problems(path.read_text(), str(path.relative_to(ROOT.parent)))]
    assert not found, "\n".join(found)


def test_pointers_into_the_tuning_notes_name_a_section():
    headings = [line for line in (ROOT.parent / "docs" / "tuning_notes.md").read_text().splitlines()
                if line.startswith("#")]
    missing = [f"{path.relative_to(ROOT.parent)}: {name!r}" for path in sorted(ROOT.rglob("*.py"))
               for quoted in re.findall(r'tuning_notes\.md,\s*(?:#\s*)?"([^"]+)"', path.read_text())
               # a name wrapped over comment lines
               for name in [re.sub(r"\s*\n\s*(?:#\s*)?", " ", quoted)]
               if not any(name in heading for heading in headings)]
    assert not missing, "no such section in docs/tuning_notes.md:\n" + "\n".join(missing)
