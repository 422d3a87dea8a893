"""Every notebook's config cell, run at default and at smoke sizes, before any model is built.

The smoke run under nbmake never executes the default branch of `pick(default, smoke)`: a default
size that contradicts another (notebook 05 timed the cross-encoder on one gallery only, then failed
to extrapolate after ten minutes of work) surfaces only at the end of a long run. Each notebook's
cells up to and including its config cell (the first that calls `pick(`) are cheap: versions,
imports, sizes and their own checks.
"""

import json
from pathlib import Path

import faiss
import pytest
import torch
from IPython.core.inputtransformer2 import TransformerManager

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = sorted(path.name for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


# what a config must hold beyond running: name -> (check of its namespace, what is wrong otherwise)
INVARIANTS = {
    "05_hivlp.ipynb": (
        lambda ns: sum(n <= ns["CROSS_MEASURED_UP_TO"] for n in ns["TABLE4_SIZES"]) >= 2,
        "Table 4 extrapolates the cross-encoder from at least two measured galleries"),
}


def cells_up_to_config(name):
    cells = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))["cells"]
    code = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
    config = next((i for i, source in enumerate(code) if "pick(" in source), None)
    return None if config is None else code[: config + 1]


@pytest.mark.parametrize("smoke", ["0", "1"])
@pytest.mark.parametrize("name", NAMES)
def test_config_cell_runs_at_both_sizes(name, smoke, monkeypatch, capsys):
    cells = cells_up_to_config(name)
    if cells is None:
        pytest.skip(f"{name} has no config cell calling pick(")
    monkeypatch.setenv("COURSE_SMOKE", smoke)
    # the notebooks' paths are relative to it
    monkeypatch.chdir(NOTEBOOKS)
    namespace = {"__name__": "__main__"}
    threads, faiss_threads = torch.get_num_threads(), faiss.omp_get_max_threads()
    try:
        for source in cells:
            # as IPython reads a cell: the install cell's %pip line (Colab only) becomes Python
            code = TransformerManager().transform_cell(source)
            exec(compile(code, f"{name} cell", "exec"), namespace)
    # setup(cpu_threads=1) must not leak into other tests
    finally:
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(faiss_threads)
    assert namespace["pick"]("default", "smoke") == ("smoke" if smoke == "1" else "default")
    if name in INVARIANTS:
        holds, why = INVARIANTS[name]
        assert holds(namespace), why


def _code_and_text(notebook):
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    join = lambda kind: "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == kind)  # noqa: E731
    return join("code"), join("markdown")


def test_notebooks_that_say_one_cpu_thread_set_it():
    # 05 and 06 said "One CPU thread" but called setup() without cpu_threads: torch and FAISS took
    # every core, and their smoke runs slowed many times over beside another busy process
    said = 0
    for notebook in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        code, text = _code_and_text(notebook)
        if "One CPU thread" not in text:
            continue
        said += 1
        by_setup = "setup(cpu_threads=1)" in code
        by_config = ("CPU_THREADS = 1" in code and "torch.set_num_threads(CPU_THREADS)" in code
                     and "faiss.omp_set_num_threads(CPU_THREADS)" in code)
        assert by_setup or by_config, f"{notebook.name} says 'One CPU thread' but does not set one"
    assert said >= 4   # 03, 04, 05, 06
