"""course_lib.colab: on Colab (google.colab faked), setup() works in the copy of the course around
the notebook, or fetches the repository at the commit pip installed and works in its notebooks/;
the package then reads the shipped models and photos of that copy. Elsewhere nothing changes.

The fetch runs for real, with git, from a local bare repository of two commits."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from course_lib import colab
from course_lib.core.shipped import shipped_folder
from course_lib.data.photos import places

ROOT = Path(__file__).resolve().parents[1]


def _git(*args, cwd):
    subprocess.run(["git", "-c", "user.name=course", "-c", "user.email=course@example.org", *args],
                   cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def bare_course(tmp_path):
    """(source folder, bare repository, first commit): a minimal course of two commits, whose
    course_lib/VERSION says "installed" in the first and "newer" in the second."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    source = tmp_path / "source"
    for folder in ("course_lib", "notebooks", "shipped_models"):
        (source / folder).mkdir(parents=True)
    (source / "course_lib" / "__init__.py").write_text("")
    (source / "shipped_models" / "manifest.json").write_text("{}")
    (source / "notebooks" / "00_x.ipynb").write_text("{}")
    (source / "course_lib" / "VERSION").write_text("installed")
    _git("init", "-q", "-b", "main", cwd=source)
    _git("add", ".", cwd=source)
    _git("commit", "-q", "-m", "course", cwd=source)
    first = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, check=True,
                           capture_output=True, text=True).stdout.strip()
    (source / "course_lib" / "VERSION").write_text("newer")
    _git("commit", "-q", "-am", "newer", cwd=source)
    _git("clone", "-q", "--bare", str(source), str(tmp_path / "retrieval-lab.git"), cwd=tmp_path)
    return source, tmp_path / "retrieval-lab.git", first


def _no_course_repository(monkeypatch):
    monkeypatch.setenv("COURSE_REPOSITORY", "")  # so that the test's end removes what it set
    monkeypatch.delenv("COURSE_REPOSITORY")


@pytest.fixture
def on_colab(monkeypatch):
    """google.colab imported, as in a Colab kernel, at default sizes (shipped models are looked
    for); COURSE_REPOSITORY and the working folder restored afterwards."""
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.delenv("COURSE_SMOKE", raising=False)
    monkeypatch.delenv("COURSE_SHIPPED_MODELS", raising=False)
    _no_course_repository(monkeypatch)
    monkeypatch.chdir(Path.cwd())
    return monkeypatch


def test_opened_alone_it_fetches_the_installed_commit_and_works_in_its_notebooks(tmp_path,
                                                                                bare_course,
                                                                                on_colab):
    _, bare, first = bare_course
    on_colab.setattr(colab, "installed_from", lambda: (bare.as_uri(), first))
    content = tmp_path / "content"  # Colab's working folder: nothing of the course on disk
    content.mkdir()
    on_colab.chdir(content)
    root = colab.use_course_files()
    assert root == content / "retrieval-lab" and Path.cwd() == root / "notebooks"
    assert (root / "course_lib" / "VERSION").read_text() == "installed"  # pip's commit
    # the package, installed elsewhere, reads that copy's shipped models and photos
    assert os.environ["COURSE_REPOSITORY"] == str(root)
    assert shipped_folder() == root / "shipped_models"
    assert places()[0] == root / "data" / "flickr8k"
    # setup() again in the same runtime, from anywhere: the copy is reused, not fetched again
    on_colab.setattr(colab, "fetch_course", lambda *args: pytest.fail("fetched twice"))
    assert colab.use_course_files() == root  # from its notebooks/
    on_colab.chdir(content)
    assert colab.use_course_files() == root and Path.cwd() == root / "notebooks"


def test_without_a_known_commit_it_fetches_the_default_branch(tmp_path, bare_course):
    _, bare, _ = bare_course
    root = colab.fetch_course(bare.as_uri(), None, tmp_path / "copy")
    assert (root / "course_lib" / "VERSION").read_text() == "newer"


def test_inside_a_copy_of_the_course_it_fetches_nothing_and_stays(bare_course, on_colab):
    source, _, _ = bare_course
    on_colab.setattr(colab, "fetch_course", lambda *args: pytest.fail("fetched inside a copy"))
    for folder in (source / "notebooks", source):  # a lesson's folder (or student/), or the root
        on_colab.chdir(folder)
        assert colab.use_course_files() == source and Path.cwd() == folder
        assert shipped_folder() == source / "shipped_models"


def test_the_package_in_its_own_repository_needs_no_pointer(on_colab):
    on_colab.chdir(ROOT / "notebooks")
    assert colab.use_course_files() == ROOT and "COURSE_REPOSITORY" not in os.environ


def test_off_colab_nothing_happens(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(colab, "fetch_course", lambda *args: pytest.fail("fetched off Colab"))
    _no_course_repository(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert colab.use_course_files() is None
    assert Path.cwd() == tmp_path and "COURSE_REPOSITORY" not in os.environ


def test_setup_says_where_the_course_files_are(bare_course, on_colab, capsys):
    from course_lib.notebook import setup

    source, _, _ = bare_course
    on_colab.chdir(source / "notebooks")
    setup()
    out = capsys.readouterr().out
    assert f"course files: {source} (working in {source / 'notebooks'})" in out


class _Distribution:
    """What installed_from reads of an installed distribution."""

    def __init__(self, direct_url: dict | None, urls=()):
        self.direct_url = direct_url
        self.metadata = types.SimpleNamespace(get_all=lambda key: list(urls))

    def read_text(self, name):
        wanted = name == "direct_url.json" and self.direct_url
        return json.dumps(self.direct_url) if wanted else None


def test_installed_from_reads_pips_record_of_the_git_install(monkeypatch):
    def installed(direct_url, urls=()):
        monkeypatch.setattr(importlib.metadata, "distribution",
                            lambda name: _Distribution(direct_url, urls))
        return colab.installed_from()

    lab = "https://github.com/alice/retrieval-lab"
    git = {"url": lab, "vcs_info": {"vcs": "git", "commit_id": "0a1b2c"}}
    assert installed(git) == (lab, "0a1b2c")
    # installed from a wheel or a folder: the package's Repository address, its default branch
    urls = ["Homepage, https://example.org", f"Repository, {lab}"]
    assert installed({"url": "file:///tmp/course", "dir_info": {}}, urls) == (lab, None)
    with pytest.raises(LookupError, match="first cell"):
        installed(None)
