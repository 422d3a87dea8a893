"""data_scripts/make_student_copies.py: solution cells become stubs, every other cell is
copied unchanged.

On a tiny notebook built here, then on the real ones: each student copy, executed in a kernel from
`notebooks/` (the notebooks read and write `../outputs`) with COURSE_SMOKE=1, stops at its first
exercise with the stub's NotImplementedError("Exercise: ..."); then, in the same kernel, the
learner's next step: the original solution cells pasted back into the copy (the same sources as the
original notebook, checked), and the first exercise's cell and its checker run again and pass. The
rest of the pasted-back copy is the original notebook from there on, which nbmake runs top to bottom
in the same test command, so it is not run a second time here (that doubled the notebooks' share of
the suite, about 5 minutes).
"""

import copy
import importlib.util
import inspect
import json
from pathlib import Path

import pytest

from course_lib.data.photos import find_photos, no_photos_message

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = sorted(path.name for path in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
# lessons that run on real photographs: where none are found they skip every cell after
# their config, so their student copy has no exercise to stop at and is skipped here,
# saying how to get the photos
NEEDS_PHOTOS = {"08_real_photographs.ipynb"}

spec = importlib.util.spec_from_file_location("make_student_copies",
                                              ROOT / "data_scripts" / "make_student_copies.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)

SOLUTION = '''# Exercise: write double(x), twice x,
# without a loop.
import math

def double(x, *, scale=2):
    """x (n,) -> (n,): every entry times `scale`."""
    return [scale * value for value in x]   # the answer

print(double([1, 2]))'''
INSTRUCTIONS = "Exercise: write double(x), twice x, without a loop."


def code(source, tags=None, outputs=()):
    return {"cell_type": "code", "execution_count": 3 if outputs else None, "id": f"c{len(source)}",
            "metadata": {"tags": tags} if tags else {"collapsed": True}, "outputs": list(outputs),
            "source": source.splitlines(keepends=True)}


def solution_cells(nb):
    return [i for i, cell in enumerate(nb["cells"])
            if "solution" in cell["metadata"].get("tags", [])]


def write(folder, name, nb):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n",
                               encoding="utf-8")


def test_tiny_notebook(tmp_path, capsys):
    output = {"name": "stdout", "output_type": "stream", "text": ["2\n"]}
    cells = [{"cell_type": "markdown", "id": "m1", "metadata": {},
              "source": ["### Exercise: twice ünïcode"]},
             code("import numpy as np\nx = 1", outputs=[output]),
             code(SOLUTION, ["solution"], outputs=[output]),
             code("check(double)  # the checker stays"),
             code("# Exercise: plot it.\nplt.plot([1, 2])", ["solution", "other"])]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3"}}, "nbformat": 4,
          "nbformat_minor": 5}
    write(tmp_path / "nb", "00_tiny.ipynb", nb)
    write(tmp_path / "nb", "notes.ipynb", nb)                    # not NN_*: not copied
    assert script.main(["--out", str(tmp_path / "out"), "--notebooks", str(tmp_path / "nb")]) == 0
    assert "wrote 1 student notebooks (2 exercises)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["00_tiny.ipynb"]
    copied = json.loads((tmp_path / "out" / "00_tiny.ipynb").read_text(encoding="utf-8"))

    assert len(copied["cells"]) == len(cells) and copied["metadata"] == nb["metadata"]
    for before, after in zip(cells, copied["cells"], strict=True):
        # outputs cleared
        assert after.get("outputs", []) == [] and after.get("execution_count") is None
        if "solution" not in before["metadata"].get("tags", []):
            unchanged = {k: v for k, v in before.items() if k not in ("outputs", "execution_count")}
            assert json.dumps({k: after[k] for k in unchanged}) == json.dumps(unchanged)
        else:
            assert after["metadata"] == before["metadata"] and after["id"] == before["id"]

    stub = "".join(copied["cells"][2]["source"])
    assert stub.startswith("# Exercise: write double(x), twice x,\n# without a loop.\n"
                           "import math\n")
    assert "the answer" not in stub and "print" not in stub
    namespace = {}
    with pytest.raises(NotImplementedError, match="^Exercise: write double"):
        # the top-level print became a raise
        exec(stub, namespace)
    assert inspect.signature(namespace["double"]) == inspect.signature(lambda x, *, scale=2: None)
    assert namespace["double"].__doc__ == "x (n,) -> (n,): every entry times `scale`."
    with pytest.raises(NotImplementedError) as raised:
        namespace["double"]([1])
    assert str(raised.value) == INSTRUCTIONS

    namespace = {}
    with pytest.raises(NotImplementedError, match="^Exercise: plot it.$"):
        exec("".join(copied["cells"][4]["source"]), namespace)
    assert "plt" not in namespace


def test_clear_errors(tmp_path, capsys):
    for args, message in ((["--notebooks", str(tmp_path / "missing")],
                           "not a folder holding NN_*.ipynb"),
                          (["--out", str(ROOT / "README.md")], "exists and is not a folder"),
                          (["--out", str(NOTEBOOKS)], "--out must differ from --notebooks")):
        with pytest.raises(SystemExit):
            script.main(["--out", str(tmp_path / "out"), *args])
        assert message in capsys.readouterr().err
    bad = {"cells": [code("def f():\n    return 1", ["solution"])], "metadata": {}, "nbformat": 4,
           "nbformat_minor": 5}
    write(tmp_path / "nb", "00_bad.ipynb", bad)
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path / "out"), "--notebooks", str(tmp_path / "nb")])
    err = capsys.readouterr().err
    assert "00_bad.ipynb: solution cell 0: a solution cell must open with" in err


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    assert script.main(["--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("name", NAMES)
def test_student_copy_stops_at_first_exercise_and_its_answer_passes(name, copies, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    if name in NEEDS_PHOTOS and find_photos() is None:
        pytest.skip(f"{name} needs real photographs: {no_photos_message()}")
    original = nbformat.read(NOTEBOOKS / name, as_version=4)
    student = nbformat.read(copies / name, as_version=4)
    solutions = solution_cells(original)
    assert solutions, f"{name} has no exercise"
    first = solutions[0]
    stubbed = [i for i, (a, b) in enumerate(zip(original.cells, student.cells, strict=True))
               if a.source != b.source]
    # checkers and the rest kept
    assert len(student.cells) == len(original.cells) and stubbed == solutions
    pasted = copy.deepcopy(student)
    for i in solutions:
        pasted.cells[i].source = original.cells[i].source
    assert [cell.source for cell in pasted.cells] == [cell.source for cell in original.cells]

    # The stub of a cell of functions raises when its checker (the next code cell) calls them.
    runs_code = any(line.startswith("raise NotImplementedError")
                    for line in student.cells[first].source.splitlines())
    expected = first if runs_code else next(i for i in range(first + 1, len(student.cells))
                                            if student.cells[i].cell_type == "code")
    message = " ".join(script.instructions(original.cells[first].source))

    monkeypatch.setenv("COURSE_SMOKE", "1")
    client = NotebookClient(student, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    with client.setup_kernel():
        failed = None
        for i, cell in enumerate(student.cells):
            if cell.cell_type == "code":
                try:
                    client.execute_cell(cell, i)
                except CellExecutionError as error:
                    failed = i, error
                    break
        assert failed is not None, f"the student copy of {name} ran to the end"
        index, error = failed
        got = (index, error.ename, error.evalue)
        assert got == (expected, "NotImplementedError", message), str(error)

        # the learner pastes the answer and runs it
        client.nb = pasted
        # the exercise's cell, then its checker
        for i in range(first, expected + 1):
            if pasted.cells[i].cell_type == "code":
                client.execute_cell(pasted.cells[i], i)


def test_a_lesson_without_its_photos_is_skipped_not_failed(copies, monkeypatch, tmp_path):
    """A learner's clone has no photos: lesson 08's student copy is skipped, saying how to get them
    (its cells after the config do nothing then, so it used to fail as "ran to the end")."""
    monkeypatch.setenv("COURSE_PHOTOS", str(tmp_path))  # an empty folder: no photos anywhere
    assert "08_real_photographs.ipynb" in NAMES
    with pytest.raises(pytest.skip.Exception, match="download_data.py flickr8k"):
        test_student_copy_stops_at_first_exercise_and_its_answer_passes(
            "08_real_photographs.ipynb", copies, monkeypatch)
