"""Make the learners' copies of the course notebooks: every exercise answer replaced by a stub.

An instructor runs, from the repository root,

    python data_scripts/make_student_copies.py --out student/   [--notebooks notebooks/]

and hands out the folder `student/`: a copy of every `NN_*.ipynb` with its outputs cleared, in which
each code cell tagged `solution` (cell metadata "tags") is replaced by a stub. Every other cell is
copied unchanged, the checkers included: they live in the untagged cell right after their exercise.
Put the folder at the same depth as `notebooks/` (e.g. `student/` at the repository root): the
notebooks read and write `../outputs/`.

The rule a solution cell follows (and the stub it becomes):
- it opens with comment lines, the first starting with `# Exercise:`; they are the instructions: the
  stub keeps them, and raises NotImplementedError("Exercise: ...") with their text;
- the stub keeps the cell's top-level imports, and every top-level function with its signature and
  docstring, its body replaced by that raise;
- if the cell does anything else at top level (runs, prints, plots), the stub ends with the raise.
A checker call belongs in the next cell, not in the solution cell, so that it stays in the copy.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def instructions(source: str) -> list[str]:
    """The leading `#` comment lines of a solution cell, without the `#`; the first says
    `Exercise:`."""
    lines = []
    for line in source.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    if not lines or not lines[0].startswith("Exercise:"):
        raise ValueError("a solution cell must open with comment lines, the first starting with "
                         "'# Exercise:'")
    return lines


def stub(source: str) -> str:
    """The stub of a solution cell (see the module docstring)."""
    lines, text = source.splitlines(), instructions(source)
    parts = [json.dumps(line + " ", ensure_ascii=False) for line in text[:-1]]
    parts.append(json.dumps(text[-1], ensure_ascii=False))  # a string literal per instruction line

    def raise_(indent: str) -> str:
        return (f"{indent}raise NotImplementedError(\n{indent}    "
                + f"\n{indent}    ".join(parts) + ")")

    out, runs_code = lines[:len(text)], False
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(ast.get_source_segment(source, node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first, body = (node.decorator_list or [node])[0].lineno, node.body[0]
            if body.lineno == node.lineno:
                raise ValueError(f"put the body of {node.name}() on its own lines")
            has_doc = ast.get_docstring(node, clean=False) is not None
            out += ["", *lines[first - 1:body.end_lineno if has_doc else body.lineno - 1],
                    raise_(" " * body.col_offset)]
        else:
            runs_code = True
    return "\n".join(out + (["", raise_("")] if runs_code else []))


def student_copy(nb: dict) -> tuple[dict, int]:
    """The notebook with its solution cells stubbed and every output cleared; and how many were
    stubbed."""
    nb, stubbed = json.loads(json.dumps(nb)), 0
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        cell["outputs"], cell["execution_count"] = [], None
        if "solution" in cell.get("metadata", {}).get("tags", []):
            try:
                cell["source"] = stub("".join(cell["source"])).splitlines(keepends=True)
            except (ValueError, SyntaxError) as error:
                raise ValueError(f"solution cell {index}: {error}") from None
            stubbed += 1
    return nb, stubbed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="folder to write the copies to (created)")
    parser.add_argument("--notebooks", type=Path, default=REPO / "notebooks",
                        help="folder of NN_*.ipynb")
    args = parser.parse_args(argv)
    sources = sorted(args.notebooks.glob("[0-9][0-9]_*.ipynb")) if args.notebooks.is_dir() else []
    if not sources:
        parser.error(f"--notebooks {args.notebooks}: not a folder holding NN_*.ipynb notebooks")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a folder")
    if args.out.resolve() == args.notebooks.resolve():
        parser.error("--out must differ from --notebooks: the copies would overwrite the solutions")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {args.out}: cannot create the folder ({error.strerror})")
    total = 0
    for path in sources:
        try:
            nb, stubbed = student_copy(json.loads(path.read_text(encoding="utf-8")))
        except ValueError as error:
            parser.error(f"{path}: {error}")
        text = json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
        (args.out / path.name).write_text(text, encoding="utf-8")
        print(f"{path.name}: {stubbed} exercise(s) stubbed")
        total += stubbed
    print(f"wrote {len(sources)} student notebooks ({total} exercises) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
