"""On Colab, the course's files that are not part of the package: a notebook opened from its badge
arrives alone (pip-installed, no clone), yet reaches the course by relative paths. So setup() works
in the copy of the course it is in, else in a shallow fetch of the repository at the commit pip
installed, and points COURSE_REPOSITORY at it."""

from __future__ import annotations

import contextlib
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
    """The copy of the course that `folder` (a notebook's folder or the root) is in, else None."""
    folder = Path(folder).resolve()
    return next((p for p in (folder.parent, folder) if (p / PACKAGE).is_dir()), None)


def installed_from() -> tuple[str, str | None]:
    """(repository URL, commit) the package was installed from: pip's record of a git install,
    else its Repository address and None (the default branch)."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        distribution = importlib.metadata.distribution(PACKAGE)
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
    subprocess.run(["git", "init", "-q", str(into)], check=True)
    for args in (["fetch", "-q", "--depth", "1", url, commit or "HEAD"],
                 ["checkout", "-q", "FETCH_HEAD"]):
        subprocess.run(["git", "-C", str(into), *args], check=True)
    return into


def use_course_files(folder=".") -> Path | None:
    """On Colab, the course copy the notebooks' paths lead into (fetched if none), else None."""
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
