"""Link every abbreviation of docs/glossary.md where it first appears in each notebook's text.

The glossary's terms are its `### TERM` headings. In each `notebooks/NN_*.ipynb`, the first
occurrence of a term in the markdown cells' running text becomes
`[TERM](../docs/glossary.md#anchor)`. Running text leaves out headings, code (spans and fenced
blocks), math (`$...$`, `$$...$$`), HTML tags and existing links, so no link lands inside code, a
formula or another link. From the repository root:

    python data_scripts/link_glossary.py          # add the missing links (new notebook or term)
    python data_scripts/link_glossary.py --check  # exit 1 if a notebook lacks one

Needs nbformat (the dev extra).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
GLOSSARY = "../docs/glossary.md"  # as the notebooks (in notebooks/) reach it
# what is not running text: fenced code, display and inline math, inline code, links (text and
# target together), HTML tags
PROTECTED = re.compile(r"```.*?```|\$\$.*?\$\$|\$[^$\n]+\$|`[^`\n]*`"
                       r"|!?\[[^\]\n]*(?:\[[^\]\n]*\][^\]\n]*)*\]\([^)\n]*\)"
                       r"|<[^>\n]+>", re.DOTALL)
HEADING = re.compile(r"^#{1,6} .*$", re.MULTILINE)


def terms(glossary: Path) -> dict[str, str]:
    """term -> its anchor, in the glossary's order (GitHub's anchors: lower case, punctuation
    dropped)."""
    found = re.findall(r"^### (.+?)\s*$", glossary.read_text(encoding="utf-8"), re.MULTILINE)
    return {term: re.sub(r"[^\w\- ]", "", term.lower()).replace(" ", "-") for term in found}


def pattern(term: str) -> re.Pattern:
    """The term as a whole word, not inside a longer name (U-BERT, VMLM, t2i_r1, EOL3, R@10);
    bi-GRU counts."""
    return re.compile(r"(?<![\w@])(?<![A-Z]-)" + re.escape(term) + r"(?![\w@])")


def free_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the running text of one markdown cell, in order."""
    taken = sorted([m.span() for m in PROTECTED.finditer(text)]
                   + [m.span() for m in HEADING.finditer(text)])
    spans, at = [], 0
    for start, end in taken:
        if start > at:
            spans.append((at, start))
        at = max(at, end)
    return spans + [(at, len(text))]


def first_occurrence(cells, term: str):
    """(cell index, position, linked) of the term's first occurrence in the running text, or its
    first occurrence as a glossary link if that comes first; None if the notebook's text never
    uses it."""
    link = re.compile(r"\[" + re.escape(term) + r"\]\(" + re.escape(GLOSSARY) + r"#")
    word = pattern(term)
    for index, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        hits = [(m.start(), True) for m in link.finditer(cell.source)]
        for start, end in free_spans(cell.source):
            hits += [(m.start(), False) for m in word.finditer(cell.source, start, end)]
        if hits:
            position, linked = min(hits)
            return index, position, linked
    return None


def link_notebook(nb, glossary_terms: dict[str, str]) -> list[str]:
    """Link each term at its first occurrence (in place); returns the terms linked now."""
    added = []
    for term, anchor in glossary_terms.items():
        found = first_occurrence(nb.cells, term)
        if found is None or found[2]:
            continue
        index, position, _ = found
        source = nb.cells[index].source
        nb.cells[index].source = (f"{source[:position]}[{term}]({GLOSSARY}#{anchor})"
                                  f"{source[position + len(term):]}")
        added.append(term)
    return added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO,
                        help="the repository's root (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a link is missing")
    args = parser.parse_args(argv)
    glossary_terms = terms(args.root / "docs" / "glossary.md")
    missing = 0
    for path in sorted((args.root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        added = link_notebook(nb, glossary_terms)
        if added and not args.check:
            nbformat.write(nb, path)
        if added:
            print(f"{path.name}: {'not linked' if args.check else 'linked'}: {', '.join(added)}")
        missing += len(added)
    if args.check and missing:
        print("run: python data_scripts/link_glossary.py")
    return 1 if args.check and missing else 0


if __name__ == "__main__":
    sys.exit(main())
