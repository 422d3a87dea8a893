"""Point the course at its repository: pyproject's address, and from it the notebooks' front matter.

The repository's address is written once, in pyproject.toml's `[project.urls]` (`Repository =
...`). Everything else that names it is generated from there by this script, in every
`notebooks/NN_*.ipynb`:

- the "Open in Colab" badge, the first line of the notebook's first (markdown) cell;
- the learners' note, a markdown cell of its own just before the install cell: where the answers
  are, how to get exercise-only copies (data_scripts/make_student_copies.py), the glossary, and
  where to ask for help (the repository's GitHub issues);
- the install cell, the first code cell (INSTALL_CELL): on Colab it installs the package from the
  repository with pip, Colab's torch pinned as it is; elsewhere it does nothing. The next cell's
  `setup()` finds or fetches the repository's other files the notebook needs (course_lib.colab).

An instructor with a fork runs, from the repository root,

    python data_scripts/set_repository.py OWNER/NAME    # pyproject, badges, notes and install cells

It also rewrites README.md's links that name the repository (each lesson's Colab link in the
syllabus, the issues link). After adding a notebook, `python data_scripts/set_repository.py` (no
address) writes its front matter from pyproject's address; `--check` only says whether every
notebook is current (exit 1 if not). Needs nbformat (the dev extra).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
GITHUB = "https://github.com/"
BRANCH = "main"  # the branch the badges open
URL_LINE = re.compile(r'^Repository\s*=\s*"([^"]*)"\s*$', re.MULTILINE)
BADGE_LINE = re.compile(r"\A\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)\n*")
NOTE_START = "**Exercises, answers and help.**"
INSTALL_FIRST_LINE = "# Colab only:"
INSTALL_CELL_ID = "colab-install"
NOTE_CELL_ID = "learners-note"

# The install cell, the same in every notebook but for its address: at most 6 lines, and nothing
# that needs course_lib, which it installs. pip leaves a requirement that is already satisfied alone
# (`torch>=2.2` against Colab's torch: nothing installed); the pin stops any other requirement from
# swapping Colab's CUDA build of torch for another, and so its torchvision too (each torchvision
# requires one torch). The last line is what IPython makes of `%pip install ...`, written out so
# that ruff sees the names it uses; __import__("sys") spares an import line and the blank line ruff
# wants after it, which 6 lines leave no room for. The runtime needs no restart, since a plain (not
# editable) install is importable at once.
INSTALL_CELL = '''\
# Colab only: install the course package from its repository, Colab's torch pinned as it is (which
# keeps its torchvision); setup() below fetches the rest. Written by data_scripts/set_repository.py
COURSE_PACKAGE = "git+{url}"
if "google.colab" in __import__("sys").modules:
    from importlib.metadata import version
    get_ipython().run_line_magic("pip", f"install -q {COURSE_PACKAGE} torch=={version('torch')}")'''


def slug(address: str) -> str:
    """OWNER/NAME from "OWNER/NAME" or a GitHub URL; a ValueError for anything else."""
    text = address.strip().removeprefix(GITHUB).removesuffix(".git").strip("/")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", text):
        raise ValueError(f"expected OWNER/NAME or {GITHUB}OWNER/NAME, got {address!r}")
    return text


def read_repository(pyproject: Path) -> str:
    """The repository URL of pyproject's [project.urls] `Repository`."""
    found = URL_LINE.search(pyproject.read_text(encoding="utf-8"))
    if found is None:
        raise ValueError(f"{pyproject}: no `Repository = \"...\"` line under [project.urls]")
    return found.group(1)


def write_repository(pyproject: Path, url: str) -> None:
    """Set pyproject's `Repository` to url (the line must exist)."""
    text = pyproject.read_text(encoding="utf-8")
    read_repository(pyproject)  # the line is there
    pyproject.write_text(URL_LINE.sub(f'Repository = "{url}"', text, count=1), encoding="utf-8")


def badge(url: str, notebook: str) -> str:
    """The "Open in Colab" badge of notebooks/<notebook> on GitHub."""
    target = f"https://colab.research.google.com/github/{slug(url)}/blob/{BRANCH}/notebooks/{notebook}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({target})"


def learners_note(url: str) -> str:
    """The markdown cell every notebook has just before its install cell."""
    return (f"{NOTE_START} In the course's notebooks the cell under each exercise, tagged "
            "`solution`, is its answer; `python data_scripts/make_student_copies.py --out "
            "student/` (from the repository root) writes copies in which those cells are stubs "
            "for you to fill in. Abbreviations are explained in "
            f"the [glossary](../docs/glossary.md). Stuck, or found a mistake? Ask in the course's "
            f"[GitHub issues]({url.rstrip('/')}/issues).")


def install_cell(url: str) -> str:
    """The source of every notebook's install cell, for the repository at url (replace, not format:
    the cell's own braces stay)."""
    return INSTALL_CELL.replace("{url}", url)


def front_matter(nb, name: str, url: str):
    """The notebook with its badge, learners' note and install cell made current (in place);
    returns it."""
    first = nb.cells[0]
    if first.cell_type != "markdown":
        raise ValueError(f"{name}: its first cell must be the markdown title cell")
    body = BADGE_LINE.sub("", first.source)
    body = body.split(f"\n\n{NOTE_START}")[0].rstrip("\n")  # a title cell may end with the note
    first.source = f"{badge(url, name)}\n\n{body}"
    install = next((c for c in nb.cells if c.cell_type == "code"), None)
    if install is not None and install.source.startswith(INSTALL_FIRST_LINE):
        install.source = install_cell(url)
    else:
        install = nbformat.v4.new_code_cell(install_cell(url), id=INSTALL_CELL_ID)
        nb.cells.insert(1, install)
    note = next((c for c in nb.cells
                 if c.cell_type == "markdown" and c.source.startswith(NOTE_START)), None)
    if note is None:
        note = nbformat.v4.new_markdown_cell("", id=NOTE_CELL_ID)
        nb.cells.insert(nb.cells.index(install), note)
    note.source = learners_note(url)
    return nb


# README.md's links that name a repository: a notebook opened on Colab, and the issues page
README_LINKS = re.compile(r"(https://colab\.research\.google\.com/github/|https://github\.com/)"
                          r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+(/blob/|/issues)")


def readme_text(text: str, url: str) -> str:
    """README.md's text with every link that names a repository pointing at `url`'s."""
    return README_LINKS.sub(lambda m: f"{m.group(1)}{slug(url)}{m.group(2)}", text)


def notebooks(root: Path) -> list[Path]:
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def stale(root: Path) -> list[str]:
    """The notebooks whose front matter (and README.md, whose links) differ from what pyproject's
    address gives."""
    url, out = read_repository(root / "pyproject.toml"), []
    for path in notebooks(root):
        nb = nbformat.read(path, as_version=4)
        before = [c.source for c in nb.cells]
        if [c.source for c in front_matter(nb, path.name, url).cells] != before:
            out.append(path.name)
    readme = root / "README.md"
    if readme.exists():
        text = readme.read_text(encoding="utf-8")
        if readme_text(text, url) != text:
            out.append(readme.name)
    return out


def apply(root: Path, address: str | None = None) -> list[str]:
    """Write the address (if given) into pyproject, then every notebook's front matter and
    README.md's links; returns the files rewritten."""
    pyproject = root / "pyproject.toml"
    if address is not None:
        write_repository(pyproject, GITHUB + slug(address))
    url = read_repository(pyproject)
    changed = []
    for path in notebooks(root):
        nb = nbformat.read(path, as_version=4)
        before = [c.source for c in nb.cells]
        if [c.source for c in front_matter(nb, path.name, url).cells] != before:
            nbformat.write(nb, path)
            changed.append(path.name)
    readme = root / "README.md"
    if readme.exists():
        text = readme.read_text(encoding="utf-8")
        if readme_text(text, url) != text:
            readme.write_text(readme_text(text, url), encoding="utf-8")
            changed.append(readme.name)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", nargs="?",
                        help="OWNER/NAME (or its GitHub URL); omitted: pyproject's")
    parser.add_argument("--root", type=Path, default=REPO,
                        help="the repository's root (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a notebook is not current")
    args = parser.parse_args(argv)
    try:
        if args.check:
            if args.address is not None:
                parser.error("--check compares with pyproject's address: give no address")
            behind = stale(args.root)
            print(f"not current: {', '.join(behind)} (run python data_scripts/set_repository.py)"
                  if behind else "every notebook's front matter is current")
            return 1 if behind else 0
        changed = apply(args.root, args.address)
    except ValueError as error:
        parser.error(str(error))
    print(f"repository {read_repository(args.root / 'pyproject.toml')}; rewrote {len(changed)} "
          "file(s)" + (f": {', '.join(changed)}" if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
