"""data_scripts/set_repository.py: the repository's address lives in pyproject alone, and every
notebook's badge, learners' note and install cell are generated from it.

The install cell is run as IPython runs it (its %pip line through IPython's transformer, its {...}
through IPython's expansion), with the shell faked so that nothing is installed: off Colab it does
nothing; with google.colab faked it installs the package from that address, Colab's torch pinned.
Fetching the course's other files is course_lib.colab's (tests/test_colab.py)."""

import ast
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager
from IPython.utils.text import DollarFormatter

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("set_repository",
                                              ROOT / "data_scripts" / "set_repository.py")
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
    pyproject = (course / "pyproject.toml").read_text()
    assert 'Repository = "https://github.com/alice/retrieval-lab"' in pyproject
    for path in script.notebooks(course):
        text = path.read_text(encoding="utf-8")
        assert DEFAULT not in text, path.name  # the old address is gone everywhere
        nb, old = nbformat.read(path, as_version=4), before[path.name]
        title = nb.cells[0].source
        assert title.splitlines()[0] == (
            "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research."
            f"google.com/github/alice/retrieval-lab/blob/main/notebooks/{path.name})")
        install = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        note = nb.cells[install - 1].source  # the learners' note, just before the install cell
        assert note.startswith(script.NOTE_START)
        assert "[GitHub issues](https://github.com/alice/retrieval-lab/issues)" in note
        assert "make_student_copies.py --out student/" in note
        assert 'COURSE_PACKAGE = "git+https://github.com/alice/retrieval-lab"' in (
            nb.cells[install].source)
        # nothing else changed: the same cells, the title's own text kept
        assert len(nb.cells) == len(old.cells)
        kept = [i for i in range(1, len(nb.cells)) if i not in (install - 1, install)]
        assert [nb.cells[i].source for i in kept] == [old.cells[i].source for i in kept]
        assert old.cells[0].source.split("\n\n", 1)[1] == title.split("\n\n", 1)[1]
    readme = (course / "README.md").read_text(encoding="utf-8")
    assert DEFAULT not in readme  # the syllabus's Colab links and the issues link follow the fork
    colab = "colab.research.google.com/github/alice/retrieval-lab/blob/main/notebooks/"
    assert all(f"{colab}{p.name}" in readme for p in script.notebooks(course))
    assert "https://github.com/alice/retrieval-lab/issues" in readme
    assert script.main(["--root", str(course)]) == 0  # a second run changes nothing
    assert "rewrote 0 file(s)" in capsys.readouterr().out
    assert script.main(["--check", "--root", str(course)]) == 0
    with pytest.raises(SystemExit):
        script.main(["not an address", "--root", str(course)])


def test_a_new_notebook_gets_its_front_matter_and_check_says_so_until_then(tmp_path):
    course = _copy_of_the_course(tmp_path)
    cells = [nbformat.v4.new_markdown_cell("# 99 · A new lesson\n\nWhat it teaches."),
             nbformat.v4.new_code_cell("print('lesson')")]
    nb = nbformat.v4.new_notebook(cells=cells)
    nbformat.write(nb, course / "notebooks" / "99_new_lesson.ipynb")
    assert script.main(["--check", "--root", str(course)]) == 1
    assert script.main(["--root", str(course)]) == 0
    nb = nbformat.read(course / "notebooks" / "99_new_lesson.ipynb", as_version=4)
    assert [c.cell_type for c in nb.cells] == ["markdown", "markdown", "code", "code"]
    assert (nb.cells[0].source.startswith("[![Open In Colab]")
            and nb.cells[0].source.endswith("\n\n# 99 · A new lesson\n\nWhat it teaches."))
    assert nb.cells[1].source.startswith(script.NOTE_START)
    assert (nb.cells[2].source.startswith(script.INSTALL_FIRST_LINE)
            and nb.cells[3].source == "print('lesson')")
    assert script.main(["--check", "--root", str(course)]) == 0


MAX_LINES = 6


def _install_cells() -> dict[str, str]:
    """Every committed notebook's install cell: its first code cell."""
    cells = {path.name: nbformat.read(path, as_version=4).cells for path in script.notebooks(ROOT)}
    return {name: next(c.source for c in nb if c.cell_type == "code") for name, nb in cells.items()}


class _Shell:
    """What the cell reaches of IPython: run_line_magic, which expands {...} in the line as
    InteractiveShell.var_expand does (its DollarFormatter, over the user namespace) and records
    the magic instead of running it."""

    def __init__(self, namespace: dict):
        self.namespace, self.magics = namespace, []

    def run_line_magic(self, name: str, line: str):
        self.magics.append((name, DollarFormatter().vformat(line, args=[], kwargs=self.namespace)))


def _run_install_cell(monkeypatch, source: str, *, colab: bool) -> tuple[list, list]:
    """Execute an install cell as IPython would, google.colab present (faked) or absent, with
    course_lib unimportable. Returns (the magics it ran, expanded; every process it started)."""
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setitem(sys.modules, "course_lib", None)  # not installed yet: an import of it fails
    started = []

    def record(*args, **kwargs):
        started.append(args)
        return subprocess.CompletedProcess(args, 0)

    for name in ("run", "call", "check_call", "check_output", "Popen"):
        monkeypatch.setattr(subprocess, name, record)
    monkeypatch.setattr(os, "system", record)
    namespace = {"__name__": "__main__"}
    shell = _Shell(namespace)
    namespace["get_ipython"] = lambda: shell
    exec(compile(TransformerManager().transform_cell(source), "install cell", "exec"), namespace)
    return shell.magics, started


def test_every_notebooks_install_cell_is_short_and_imports_no_course_lib():
    for name, source in _install_cells().items():
        lines = source.splitlines()
        assert len(lines) <= MAX_LINES, f"{name}: {len(lines)} lines, at most {MAX_LINES}"
        assert all(len(line) <= 100 for line in lines), name
        tree = ast.parse(TransformerManager().transform_cell(source))
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] == "course_lib"], name


@pytest.mark.parametrize("name", sorted(_install_cells()))
def test_the_install_cell_does_nothing_off_colab(name, monkeypatch):
    magics, started = _run_install_cell(monkeypatch, _install_cells()[name], colab=False)
    assert magics == [] and started == []  # no pip, no process: local Jupyter, nbmake and CI alike


@pytest.mark.parametrize("name", sorted(_install_cells()))
def test_the_install_cell_on_colab_installs_the_package_with_colabs_torch_pinned(name, monkeypatch):
    url = script.read_repository(ROOT / "pyproject.toml")
    magics, started = _run_install_cell(monkeypatch, _install_cells()[name], colab=True)
    assert started == []  # everything goes through %pip, in the kernel's own environment
    assert magics == [("pip", f"install -q git+{url} torch=={importlib.metadata.version('torch')}")]
    # a plain install: not editable, no upgrade of what Colab has, importable without a restart
    options = set(magics[0][1].split())
    assert not {"-e", "--editable", "-U", "--upgrade", "--force-reinstall"} & options


def test_the_install_cell_of_a_fork_installs_the_fork(monkeypatch):
    fork = "https://github.com/alice/retrieval-lab"
    magics, _ = _run_install_cell(monkeypatch, script.install_cell(fork), colab=True)
    assert magics[0][1].split()[2] == f"git+{fork}"


def test_a_title_cell_ending_with_the_learners_note_has_it_moved_into_a_cell_of_its_own():
    url = "https://github.com/alice/retrieval-lab"
    title = f"# 99 · A lesson\n\nWhat it teaches.\n\n{script.learners_note(url)}"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(title),
                                         nbformat.v4.new_code_cell("print('lesson')")])
    script.front_matter(nb, "99_lesson.ipynb", url)
    sources = [c.source for c in nb.cells]
    badge = script.badge(url, "99_lesson.ipynb")
    assert sources[0] == f"{badge}\n\n# 99 · A lesson\n\nWhat it teaches."
    assert sources[1:] == [script.learners_note(url), script.install_cell(url), "print('lesson')"]
    assert [c.source for c in script.front_matter(nb, "99_lesson.ipynb", url).cells] == sources
