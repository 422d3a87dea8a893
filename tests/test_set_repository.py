"""data_scripts/set_repository.py: the repository's address lives in pyproject alone, every notebook's
badge, learners' note and install cell are generated from it, and the install cell, run as on Colab
(google.colab faked), clones the course from that address and installs it with torch pinned.

The cell is run for real against a local bare git repository; only pip is faked (its command recorded)."""

import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("set_repository", ROOT / "data_scripts" / "set_repository.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
DEFAULT = "fast-retrieval-course/fast-retrieval-course"


def _copy_of_the_course(tmp_path) -> Path:
    copy = tmp_path / "course"
    (copy / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    shutil.copy(ROOT / "README.md", copy / "README.md")
    for path in script.notebooks(ROOT):
        shutil.copy(path, copy / "notebooks" / path.name)
    return copy


def test_the_committed_notebooks_carry_the_front_matter_of_pyprojects_address():
    url = script.read_repository(ROOT / "pyproject.toml")
    assert url.startswith("https://github.com/") and script.slug(url)
    assert script.stale(ROOT) == [], "run: python data_scripts/set_repository.py"
    for path in script.notebooks(ROOT):
        nb = nbformat.read(path, as_version=4)
        assert nb.cells[0].source.startswith("[![Open In Colab]"), path.name
        assert f"/blob/main/notebooks/{path.name})" in nb.cells[0].source.splitlines()[0]
        first_code = next(c for c in nb.cells if c.cell_type == "code")
        assert first_code.source == script.install_cell(url)


def test_a_fork_is_written_into_pyproject_badges_notes_and_install_cells(tmp_path, capsys):
    course = _copy_of_the_course(tmp_path)
    before = {p.name: nbformat.read(p, as_version=4) for p in script.notebooks(course)}
    assert script.main(["alice/retrieval-lab", "--root", str(course)]) == 0
    assert 'Repository = "https://github.com/alice/retrieval-lab"' in (course / "pyproject.toml").read_text()
    for path in script.notebooks(course):
        text = path.read_text(encoding="utf-8")
        assert DEFAULT not in text, path.name  # the old address is gone everywhere
        nb, old = nbformat.read(path, as_version=4), before[path.name]
        title = nb.cells[0].source
        assert title.splitlines()[0] == (
            "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research."
            f"google.com/github/alice/retrieval-lab/blob/main/notebooks/{path.name})")
        assert "[GitHub issues](https://github.com/alice/retrieval-lab/issues)" in title
        assert "make_student_copies.py --out student/" in title
        assert 'REPOSITORY = "https://github.com/alice/retrieval-lab"' in nb.cells[1].source
        # nothing else changed: the same cells, the title's own text kept
        assert len(nb.cells) == len(old.cells)
        assert [c.source for c in nb.cells[2:]] == [c.source for c in old.cells[2:]]
        assert old.cells[0].source.split("\n\n", 1)[1].split("\n\n**Exercises")[0] in title
    readme = (course / "README.md").read_text(encoding="utf-8")
    assert DEFAULT not in readme  # the syllabus's Colab links and the issues link follow the fork
    assert all(f"colab.research.google.com/github/alice/retrieval-lab/blob/main/notebooks/{p.name}" in readme
               for p in script.notebooks(course))
    assert "https://github.com/alice/retrieval-lab/issues" in readme
    assert script.main(["--root", str(course)]) == 0  # a second run changes nothing
    assert "rewrote 0 file(s)" in capsys.readouterr().out
    assert script.main(["--check", "--root", str(course)]) == 0
    with pytest.raises(SystemExit):
        script.main(["not an address", "--root", str(course)])


def test_a_new_notebook_gets_its_front_matter_and_check_says_so_until_then(tmp_path):
    course = _copy_of_the_course(tmp_path)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 99 · A new lesson\n\nWhat it teaches."),
                                         nbformat.v4.new_code_cell("print('lesson')")])
    nbformat.write(nb, course / "notebooks" / "99_new_lesson.ipynb")
    assert script.main(["--check", "--root", str(course)]) == 1
    assert script.main(["--root", str(course)]) == 0
    nb = nbformat.read(course / "notebooks" / "99_new_lesson.ipynb", as_version=4)
    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "code"]
    assert nb.cells[0].source.startswith("[![Open In Colab]") and "What it teaches." in nb.cells[0].source
    assert nb.cells[1].source.startswith(script.INSTALL_FIRST_LINE) and nb.cells[2].source == "print('lesson')"
    assert script.main(["--check", "--root", str(course)]) == 0


def _git(*args, cwd):
    subprocess.run(["git", "-c", "user.name=course", "-c", "user.email=course@example.org", *args], cwd=cwd,
                   check=True, capture_output=True)


@pytest.fixture
def bare_course(tmp_path):
    """A local bare git repository holding a minimal course (course_lib/, notebooks/, pyproject.toml)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    source = tmp_path / "source"
    (source / "course_lib").mkdir(parents=True)
    (source / "notebooks").mkdir()
    (source / "course_lib" / "__init__.py").write_text("")
    (source / "notebooks" / "00_x.ipynb").write_text(json.dumps(nbformat.v4.new_notebook()))
    (source / "pyproject.toml").write_text('[project]\nname = "course_lib"\n')
    _git("init", "-q", "-b", "main", cwd=source)
    _git("add", ".", cwd=source)
    _git("commit", "-q", "-m", "course", cwd=source)
    _git("clone", "-q", "--bare", str(source), str(tmp_path / "retrieval-lab.git"), cwd=tmp_path)
    return source, tmp_path / "retrieval-lab.git"


def _run_cell_as_on_colab(monkeypatch, source: str, cwd: Path, *, colab: bool = True):
    """Execute an install cell in `cwd` with google.colab faked (or absent) and course_lib not importable;
    git runs, pip is recorded. Returns the recorded pip commands."""
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    real_find_spec, real_run = importlib.util.find_spec, subprocess.run
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "course_lib" else real_find_spec(name, *a))
    pip = []

    def run(command, *args, **kwargs):
        if command[0] == "git":
            return real_run(command, *args, **kwargs)
        pip.append(list(command))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(cwd)
    exec(compile(source, "install cell", "exec"), {})
    return pip


def _pins(command) -> str:
    return Path(command[command.index("-c") + 1]).read_text()


def test_the_install_cell_clones_the_course_when_opened_on_its_own(tmp_path, monkeypatch, bare_course):
    _, bare = bare_course
    content = tmp_path / "content"  # Colab's working folder: no course on disk
    content.mkdir()
    pip = _run_cell_as_on_colab(monkeypatch, script.install_cell(bare.as_uri()), content)
    clone = content / "retrieval-lab"
    assert (clone / "course_lib" / "__init__.py").exists() and (clone / ".git").is_dir()
    assert Path.cwd() == clone / "notebooks"  # where the lessons read ../outputs/
    assert len(pip) == 1 and pip[0][:4] == [sys.executable, "-m", "pip", "install"]
    assert pip[0][-2:] == ["-e", str(clone)] and "--upgrade" not in pip[0] and "-U" not in pip[0]
    pins = _pins(pip[0]).split()
    assert f"torch=={importlib.metadata.version('torch')}" in pins  # Colab's torch is kept, never replaced
    assert f"torchvision=={importlib.metadata.version('torchvision')}" in pins
    assert sys.path[0] == str(clone)
    # run again (the learner re-runs the cell): the clone is reused, not fetched twice
    monkeypatch.chdir(content)
    pip = _run_cell_as_on_colab(monkeypatch, script.install_cell(bare.as_uri()), content)
    assert pip[0][-2:] == ["-e", str(clone)]


def test_the_install_cell_inside_the_course_installs_it_without_cloning(tmp_path, monkeypatch, bare_course):
    source, bare = bare_course
    pip = _run_cell_as_on_colab(monkeypatch, script.install_cell(bare.as_uri()), source / "notebooks")
    assert [command[-2:] for command in pip] == [["-e", str(source)]]
    assert not (source / "notebooks" / "retrieval-lab").exists() and Path.cwd() == source / "notebooks"


def test_the_install_cell_does_nothing_off_colab(tmp_path, monkeypatch, bare_course):
    _, bare = bare_course
    pip = _run_cell_as_on_colab(monkeypatch, script.install_cell(bare.as_uri()), tmp_path, colab=False)
    assert pip == [] and not (tmp_path / "retrieval-lab").exists()
