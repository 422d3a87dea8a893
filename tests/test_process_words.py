"""The lessons, the docs and the library speak about the course, not about how it was made: no
working rounds ("stop 4", "round 2"), tracker numbers ("issue 22"), borrowed machines ("a lent
GPU"), and no dates outside the dated records (docs/tuning_notes.md, the lab log, and
docs/measurements.md, the record of runs).

One test per file, so a failure names the file and the words."""

import json
import re
from pathlib import Path

import pytest
from test_code_text import DATE, PROCESS

ROOT = Path(__file__).resolve().parents[1]
# the words test_code_text keeps out of course_lib, and in prose a working "session" too
PROCESS_WORDS = re.compile(PROCESS.pattern + r"|\bworking round|\bsessions?\b", re.IGNORECASE)
# the lab log and the record of runs
DATED_RECORDS = ("docs/tuning_notes.md", "docs/measurements.md")


def _files():
    """What a learner reads: the notebooks, the docs and the README (course_lib: test_code_text)."""
    paths = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "docs").glob("*.md"))
    return [p.relative_to(ROOT).as_posix() for p in paths + [ROOT / "README.md"]]


def _text(path: Path) -> str:
    """A notebook's cell sources (outputs are not committed), or a file's text."""
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"])
                         for cell in json.loads(path.read_text(encoding="utf-8"))["cells"])
    return path.read_text(encoding="utf-8")


def _problems(name: str) -> list[str]:
    text = _text(ROOT / name)
    found = [m.group(0) for m in PROCESS_WORDS.finditer(text)]
    if name not in DATED_RECORDS:
        found += [m.group(0) for m in DATE.finditer(text)]
    return found


@pytest.mark.parametrize("name", _files())
def test_no_process_words(name):
    problems = _problems(name)
    assert not problems, (f"{name}: {sorted(set(problems))}; "
                          "say what the course is, not how it was made")


def test_the_scan_catches_what_it_is_for():
    words = ["after stop 4 we", "stops 3", "issue 22", "in round 2", "this working round",
             "a lent GPU", "on a lent H100", "a borrowed machine", "in the fifth session"]
    assert all(PROCESS_WORDS.search(w) for w in words)
    assert not any(PROCESS_WORDS.search(w) for w in ["stop growing", "the issue is", "round trip",
                                                     "lentil", "an InferenceSession"])
    assert DATE.search("run of 2026-11-29.") and not DATE.search("version 2026.9")
