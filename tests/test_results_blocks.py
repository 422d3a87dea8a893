"""--readme's two blocks: the README gets the test setting's table and the frontier picture,
docs/results.md every other table and each method's notes, and together they hold every line of
DIR/results.md."""

from __future__ import annotations

import pytest

from course_lib import results as results_io

START, END = results_io.README_START, results_io.README_END


def row(method, setting, ms=1.5, notes="", measured=True, **recalls):
    cuts = (5, 10, 20) if setting == "full" else (1, 5, 10)
    r = {"method": method, "setting": setting, "n_images": 12 if setting == "full" else 4,
         "n_texts": 60 if setting == "full" else 20, "n_text_queries": 20, "n_image_queries": 4,
         **{f"{d}_r{k}": recalls.get(f"{d}_r{k}", 10.0 * k) for d in ("i2t", "t2i") for k in cuts},
         "ar": 50.0, "ms_per_query": ms, "ms_measured": measured, "notes": notes}
    if ms is not None and measured:
        r.update(ms_p25=ms * 0.9, ms_p75=ms * 1.1)
    return r


@pytest.fixture
def results():
    """A small run: one sampled method on test, an extrapolated time only on full."""
    rows = [row("oracle", s, ms=None) for s in results_io.SETTINGS]
    rows += [row("vsepp", "test", t2i_r1=26.9),
             row("slow", "test", ms=122.0, notes="sampled 250 captions"),
             row("vsepp", "full", ms=0.793),
             row("slow", "full", ms=1260.0, measured=False, notes="sampled"),
             row("vsepp", "compositional", ms=0.28),
             row("slow", "compositional", ms=105.0, notes="sampled")]
    latency = [{"method": "vsepp", "n": 1000, "ms_per_query": 0.283, "measured": True},
               {"method": "slow", "n": 5000, "ms_per_query": 642.0, "measured": False}]
    return {"meta": {"mode": "default", "seed": 0, "device": "cpu", "torch": "2.x",
                     "seconds": 795.8, "shipped_models": ["vsepp", "slow"]},
            "rows": rows, "latency": latency,
            "methods": {"vsepp": "dual encoder, hinge loss", "slow": "captioning likelihood"}}


@pytest.fixture
def course(tmp_path):
    """A README and a docs/results.md, each with a results block and text around it."""
    (tmp_path / "docs").mkdir()
    readme, doc = tmp_path / "README.md", tmp_path / "docs" / "results.md"
    readme.write_text(f"intro\n{START}\nold table\n{END}\noutro\n")
    doc.write_text(f"# Results\n\nhow to read them\n{START}\nold tables\n{END}\nafter\n")
    return readme, doc


def block(path):
    return path.read_text().split(START + "\n", 1)[1].split(END, 1)[0]


def test_the_readme_gets_the_test_table_and_docs_the_rest(course, results):
    readme, doc = course
    results_io.update_readme(results, readme)
    front, rest = block(readme), block(doc)
    assert (readme.read_text().startswith(f"intro\n{START}\n")
            and readme.read_text().endswith(f"{END}\noutro\n"))
    assert doc.read_text().startswith(f"# Results\n\nhow to read them\n{START}\n")
    assert doc.read_text().endswith(f"{END}\nafter\n")
    assert "old table" not in front and "old tables" not in rest
    assert "**test** (4 images, 20 captions)" in front and "| vsepp | " in front
    assert "**full**" not in front and "**compositional**" not in front
    assert "ms per text query vs gallery size" not in front and "Methods:" not in front
    assert "**test**" not in rest
    assert "**full** (12 images, 60 captions" in rest and "**compositional**" in rest
    assert "| slow | – | 642* |" in rest and "- `slow`: captioning likelihood" in rest
    assert "[`docs/results.md`](docs/results.md)" in front
    assert "![every method's recall against its ms per query](docs/pareto.png)" in front
    assert (readme.parent / "docs" / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (sorted(p.name for p in (readme.parent / "docs").iterdir())
            == ["pareto.png", "results.md"])


def test_each_block_explains_only_the_marks_it_shows(course, results):
    readme, doc = course
    results_io.update_readme(results, readme)
    front, rest = block(readme), block(doc)
    assert "| slow† |" in front and "† too slow" in front
    assert "* ms/query extrapolated" not in front  # only full has an extrapolated row
    assert "* ms/query extrapolated" in rest and "| slow† | " in rest and "1.26e+03* |" in rest


def test_the_two_blocks_hold_every_line_of_the_whole_table(course, results):
    readme, doc = course
    results_io.update_readme(results, readme)
    shown = set(block(readme).splitlines()) | set(block(doc).splitlines())
    assert set(results_io.results_markdown(results).splitlines()) <= shown
    # the docs block is the whole table less the test setting's section, in the same order
    whole = results_io.results_markdown(results)
    test_part = whole.split("**test**", 1)[1].split("**full**", 1)[0]
    assert block(doc) == whole.replace("**test**" + test_part, "")


def test_a_missing_docs_block_stops_before_anything_is_written(course, results):
    readme, doc = course
    doc.write_text("# Results\n\nno markers\n")
    before = readme.read_text()
    for check_only in (True, False):
        with pytest.raises(ValueError, match="results.md has no results block"):
            results_io.update_readme(results, readme, check_only=check_only)
    assert readme.read_text() == before and not (readme.parent / "docs" / "pareto.png").exists()
    doc.unlink()
    with pytest.raises(ValueError, match="cannot read"):
        results_io.update_readme(results, readme, check_only=True)


def test_check_only_writes_nothing(course, results):
    readme, doc = course
    before = readme.read_text(), doc.read_text()
    results_io.update_readme(None, readme, check_only=True)
    assert (readme.read_text(), doc.read_text()) == before
    assert not (readme.parent / "docs" / "pareto.png").exists()


def test_a_failed_picture_leaves_both_files_as_they_were(course, results, monkeypatch):
    readme, doc = course
    before = readme.read_text(), doc.read_text()

    def broken(rows, path, published=None):
        raise RuntimeError("the plot failed")
    monkeypatch.setattr(results_io, "_save_pareto", broken)
    with pytest.raises(RuntimeError, match="the plot failed"):
        results_io.update_readme(results, readme)
    assert (readme.read_text(), doc.read_text()) == before
    assert sorted(p.name for p in readme.parent.iterdir()) == ["README.md", "docs"]
    assert sorted(p.name for p in (readme.parent / "docs").iterdir()) == ["results.md"]


def test_a_real_photo_run_fills_its_own_blocks_and_leaves_the_synthetic_ones(course, results,
                                                                             tmp_path):
    readme, doc = course
    real_start, real_end = results_io.REAL_START, results_io.REAL_END
    for path in (readme, doc):
        path.write_text(path.read_text() + f"real\n{real_start}\nold real\n{real_end}\nend\n")
    synthetic = (readme.read_text(), doc.read_text())
    real = {**results, "meta": {**results["meta"], "data": "real"}, "latency": [],
            "rows": [r for r in results["rows"]
                     if r["setting"] in ("test", "full") and r["method"] != "oracle"]}
    results_io.update_readme(real, readme)
    for path, before in zip((readme, doc), synthetic, strict=True):
        text = path.read_text()
        # the synthetic block is untouched
        assert text.split(real_start)[0] == before.split(real_start)[0]
        inside = text.split(real_start + "\n", 1)[1].split(real_end, 1)[0]
        assert "old real" not in inside and text.endswith(f"{real_end}\nend\n")
    front = readme.read_text().split(real_start, 1)[1]
    assert "**test**" in front and "**full**" not in front and "pareto-real.png" in front
    assert "**full**" in doc.read_text().split(real_start, 1)[1]
    assert (tmp_path / "docs" / "pareto-real.png").stat().st_size > 0
    assert not (tmp_path / "docs" / "pareto.png").exists()  # the synthetic picture is not redrawn


def test_a_real_photo_run_without_its_block_stops_before_any_work(course):
    readme, _ = course
    with pytest.raises(ValueError, match="real-results:start"):
        results_io.update_readme(None, readme, check_only=True, real=True)
