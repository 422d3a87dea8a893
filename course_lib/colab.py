"""On Colab, the course's files that are not part of the package.

A notebook opened from its "Open in Colab" badge arrives alone: its first cell installs the package
from the repository (pip, no clone). Yet the notebooks reach the course by relative paths
(`../outputs/checkpoints`, `../data_scripts/...`, the repository's root), and the package reads the
repository's `shipped_models/` and `data/`. So `setup()` (course_lib.notebook) first calls
`use_course_files()`, which works

    on Colab, in a copy of the course     in that copy (a notebook in its notebooks/ or student/)
    on Colab, anywhere else (/content)    in ./NAME/notebooks, NAME a shallow fetch of the
                                          repository at the commit pip installed (once)
    elsewhere                             nothing changes

and, when the imported package is not in that copy, sets COURSE_REPOSITORY to it: the package then
reads its shipped models and photos (course_lib.core.settings.course_repository), and the lessons
write to its outputs/, in the runtime's writable /content.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from course_lib.core.settings import course_repository

PACKAGE = "course_lib"


def on_colab() -> bool:
    """True in a Colab runtime (its kernel imports google.colab before any cell runs)."""
    return "google.colab" in sys.modules


def course_copy(folder=".") -> Path | None:
    """The copy of the course that `folder` is in: its parent or itself when it holds course_lib/
    (a notebook's folder, or the repository's root), else None."""
    folder = Path(folder).resolve()
    return next((p for p in (folder.parent, folder) if (p / PACKAGE).is_dir()), None)


def installed_from() -> tuple[str, str | None]:
    """(repository URL, commit) the package was installed from: pip's record of a `git+URL` install,
    else its Repository address (pyproject's [project.urls]) and None (the default branch)."""
    try:
        distribution = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        distribution = None
    if distribution is not None:
        direct = json.loads(distribution.read_text("direct_url.json") or "{}")
        if direct.get("vcs_info", {}).get("vcs") == "git":
            return direct["url"], direct["vcs_info"].get("commit_id")
        for entry in distribution.metadata.get_all("Project-URL") or ():
            label, _, url = entry.partition(",")
            if label.strip().lower() == "repository":
                return url.strip(), None
    raise LookupError(f"{PACKAGE} was not installed from its repository: run the notebook's first "
                      "cell, or clone the course and open the notebook from its notebooks/ folder")


def fetch_course(url: str, commit: str | None, into: Path) -> Path:
    """The repository at `commit` (None: its default branch) in `into`, no history (depth 1)."""
    def git(*args):
        subprocess.run(["git", *args], check=True)

    git("init", "-q", str(into))
    git("-C", str(into), "fetch", "-q", "--depth", "1", url, commit or "HEAD")
    git("-C", str(into), "checkout", "-q", "FETCH_HEAD")
    return into


def use_course_files(folder=".") -> Path | None:
    """On Colab, the copy of the course the notebooks' relative paths lead into, fetched when
    `folder` is in none (see the module's docstring); elsewhere None, and nothing changes."""
    if not on_colab():
        return None
    root = course_copy(folder)
    if root is None:
        url, commit = installed_from()
        root = Path(folder).resolve() / url.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git")
        if not (root / PACKAGE).is_dir():  # a second setup() in the same runtime reuses it
            fetch_course(url, commit, root)
        os.chdir(root / "notebooks")
    if course_repository() != root:
        os.environ["COURSE_REPOSITORY"] = str(root)
    return root


__all__ = ["on_colab", "course_copy", "installed_from", "fetch_course", "use_course_files"]
