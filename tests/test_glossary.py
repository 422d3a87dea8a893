"""docs/glossary.md defines every abbreviation the lessons use, and data_scripts/link_glossary.py
links each where it first appears in each notebook's running text (never inside code, math, a
heading or a link)."""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("link_glossary",
                                              ROOT / "data_scripts" / "link_glossary.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
GLOSSARY = ROOT / "docs" / "glossary.md"
REQUIRED = ["CMR", "t2i", "i2t", "VMLM", "SMRM", "EOL", "AR", "ITM", "LRM", "R@K", "rsum", "MRC-kl",
            "FAISS", "ANN", "VSE++", "SCAN", "UNITER", "ViT", "CLS", "BERT", "LSE", "AMP"]


def _entries():
    """term -> its definition's text, read from the `### TERM` headings."""
    parts = re.split(r"^### (.+)$", GLOSSARY.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {term.strip(): body.split("\n## ")[0].strip()
            for term, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_required_abbreviation_is_defined_briefly_with_its_source():
    entries = _entries()
    assert set(REQUIRED) <= set(entries), sorted(set(REQUIRED) - set(entries))
    for term, text in entries.items():
        assert text and len(text) <= 330, f"{term}: one or two lines"
        cites = r"\d{4}|eq\.|§|lesson|FAISS|BERT|UNITER|HiVLP|LightningDOT|VSE|SCAN"
        assert re.search(cites, text), term


def test_each_glossary_link_of_a_notebook_points_at_an_entry():
    # GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, spaces as -
    anchors = {re.sub(r"[^a-z0-9 _-]", "", term.lower()).replace(" ", "-") for term in _entries()}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        text = path.read_text(encoding="utf-8")
        for term, anchor in re.findall(r"\[([^\]]+)\]\(\.\./docs/glossary\.md#([^)]+)\)", text):
            assert anchor in anchors, f"{path.name}: [{term}] links to a missing #{anchor}"


def test_every_notebook_links_each_term_where_it_first_appears():
    assert script.main(["--check"]) == 0, "run: python data_scripts/link_glossary.py"


def test_the_first_occurrence_in_running_text_is_linked_and_nothing_else():
    source = ("## CMR in a heading\n\nThe `CMR` loss, $L_{CMR}$, a [CMR link](x), U-BERT, "
              "a bi-GRU, then CMR in prose and CMR again; BERT.")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(source)])
    added = script.link_notebook(nb, {"CMR": "cmr", "BERT": "bert", "GRU": "gru", "SCAN": "scan"})
    assert added == ["CMR", "BERT", "GRU"]
    assert nb.cells[0].source == (
        "## CMR in a heading\n\nThe `CMR` loss, $L_{CMR}$, a [CMR link](x), U-BERT, "
        "a bi-[GRU](../docs/glossary.md#gru), then [CMR](../docs/glossary.md#cmr) in prose and "
        "CMR again; [BERT](../docs/glossary.md#bert).")
    # once linked, left alone
    assert script.link_notebook(nb, {"CMR": "cmr", "BERT": "bert", "GRU": "gru"}) == []


@pytest.mark.parametrize("term, anchor",
                         [("R@K", "rk"), ("VSE++", "vse"), ("MRC-kl", "mrc-kl"), ("t2i", "t2i")])
def test_anchors_follow_githubs_rule(term, anchor):
    assert script.terms(GLOSSARY)[term] == anchor
