"""The package metadata, the conda environment and the settings module agree with each other."""

import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest brings tomli
    import tomli as tomllib
from pathlib import Path

import torch

from course_lib import settings

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
    assert sorted(conda) == sorted(declared), "environment.yml's pip section must list pyproject's requirements"
    assert any(e.startswith("-e") and "[dev]" in e for e in _pip_section_of_environment_yml())


def test_notebook_progress_bars_have_their_widgets():
    # tqdm.auto in Jupyter needs ipywidgets, else every first progress bar warns "IProgress not found"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(req.startswith("ipywidgets") for req in project["optional-dependencies"]["dev"])


def test_dependencies_are_lower_bounded_not_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for req in list(project["dependencies"]) + list(project["optional-dependencies"]["dev"]):
        assert ">=" in req and "==" not in req, f"{req}: give a lower bound, do not pin"
    names = _requirement_names(project["dependencies"])
    for needed in ("torch", "torchvision", "timm", "transformers", "tokenizers", "faiss-cpu", "numpy",
                   "matplotlib", "pillow", "tqdm"):
        assert needed in names


def test_smoke_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("COURSE_SMOKE", "1")
    assert settings.smoke_mode() and settings.pick(100, 3) == 3
    monkeypatch.setenv("COURSE_SMOKE", "0")
    assert not settings.smoke_mode() and settings.pick(100, 3) == 100
    monkeypatch.delenv("COURSE_SMOKE")
    assert not settings.smoke_mode()


def test_device_choice_and_override(monkeypatch):
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    expected = "cuda" if torch.cuda.is_available() else None
    device = settings.get_device()
    if expected:
        assert device.type == expected
    assert settings.get_device("cpu").type == "cpu"
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert settings.get_device().type == "cpu"


def test_seed_everything_repeats_random_streams():
    import random

    import numpy as np

    settings.seed_everything(7)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    settings.seed_everything(7)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_describe_environment_names_versions_and_device():
    info = settings.describe_environment()
    for key in ("python", "torch", "device", "timm", "transformers", "faiss"):
        assert key in info and info[key]


def test_hub_offline_flag_is_read_at_call_time(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    assert settings.hub_offline()
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    assert not settings.hub_offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert settings.hub_offline()


def test_from_hub_follows_the_offline_switch_and_explains_failures(monkeypatch):
    import pytest

    seen = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert settings.from_hub(lambda **kw: seen.append(kw) or "loaded", "x", "fix") == "loaded"
    assert seen == [{"local_files_only": True}]

    def failing(**kw):
        raise ConnectionError("no route to host\nlong traceback text")

    with pytest.raises(OSError, match=r"could not load the thing \(HF_HUB_OFFLINE.*ConnectionError: no route"
                                      r" to host\n.*internet.*use the offline way") as info:
        settings.from_hub(failing, "the thing", "use the offline way")
    assert isinstance(info.value.__cause__, ConnectionError) and "long traceback" not in str(info.value)


def test_course_config_mixin_gives_smoke_sizes_and_dicts(monkeypatch):
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass
    class Toy(settings.CourseConfig):
        steps: int = 1000
        width: int = 64
        SMOKE: ClassVar[dict] = {"steps": 10}

    assert Toy.smoke() == Toy(steps=10) and Toy.smoke(width=8) == Toy(steps=10, width=8)
    assert Toy().to_dict() == {"steps": 1000, "width": 64}
    monkeypatch.setenv("COURSE_SMOKE", "1")
    assert Toy.for_course() == Toy(steps=10)
    monkeypatch.setenv("COURSE_SMOKE", "0")
    assert Toy.for_course() == Toy()


def _code_and_text(notebook):
    import json

    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    join = lambda kind: "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == kind)  # noqa: E731
    return join("code"), join("markdown")


def test_notebooks_that_say_one_cpu_thread_set_it():
    # 05 and 06 said "One CPU thread" but called setup() without cpu_threads: torch and FAISS took every
    # core, and their smoke runs slowed many times over beside another busy process
    said = 0
    for notebook in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        code, text = _code_and_text(notebook)
        if "One CPU thread" not in text:
            continue
        said += 1
        by_setup = "setup(cpu_threads=1)" in code
        by_config = ("CPU_THREADS = 1" in code and "torch.set_num_threads(CPU_THREADS)" in code
                     and "faiss.omp_set_num_threads(CPU_THREADS)" in code)
        assert by_setup or by_config, f"{notebook.name} says 'One CPU thread' but does not set one"
    assert said >= 4   # 03, 04, 05, 06
