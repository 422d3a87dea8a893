"""The published rows (course_lib.published): the data README's numbers, in the benchmark's markdown
and marked on its frontier's test panel, labels clear of the methods'."""

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from course_lib import pareto_plot  # noqa: E402
from course_lib.published import PUBLISHED, published_markdown, published_rows  # noqa: E402
from course_lib.results import results_markdown  # noqa: E402

DATA_README = Path(__file__).resolve().parents[2] / "shared" / "data" / "flickr8k" / "README.md"
SMOKE_ROWS = Path(__file__).parent / "data" / "pareto_rows_smoke_run.json"


def test_the_flickr8k_rows_are_the_data_readmes_numbers():
    if not DATA_README.is_file():
        pytest.skip(f"no {DATA_README}: the shared Flickr8k folder is not beside this clone")
    text = " ".join(DATA_README.read_text().split())
    t2i = text.split("text-to-image R@1:", 1)[1].split("Image-to-text R@1 of the same:")
    t2i_numbers = [float(x) for x in re.findall(r"\d+\.\d", t2i[0])]
    i2t_numbers = [float(x) for x in re.findall(r"\d+\.\d", t2i[1])]
    named = re.findall(r"(Kiros|Karpathy|Klein|Ma) et al\.|(Karpathy) & Fei-Fei", t2i[0])
    by_author = {a or b: (t, i)
                 for (a, b), t, i in zip(named, t2i_numbers, i2t_numbers, strict=True)}
    ours = {r.paper.split()[0]: (r.t2i_r1, r.i2t_r1) for r in PUBLISHED["flickr8k"]["rows"]}
    assert len(by_author) == 4
    for author, numbers in by_author.items():
        assert ours[author] == numbers, author


def test_published_rows_only_for_a_dataset_that_has_them():
    rows = published_rows("flickr8k")
    assert rows["gallery"] == 1000 and len(rows["rows"]) == len(PUBLISHED["flickr8k"]["rows"])
    assert published_rows("synthetic") is None and published_rows(None) is None


def test_the_markdown_names_the_gallery_difference():
    table = published_markdown(published_rows("flickr8k"), our_gallery=500)
    assert "1,000 photos; ours: 500, so 2x the distractors" in table
    assert "| Klein et al. 2015 | VGG | Fisher vectors + CCA | 31.0 | 21.2 |" in table
    # what we do not have is a dash, not a guess
    assert "| NAA 2019 | ResNet | – | – | 27.7 |" in table
    results = {"meta": {"mode": "default", "seed": 0, "device": "cpu", "torch": "x",
                        "seconds": 1.0},
               "rows": [{"method": "fast", "setting": "test", "n_images": 500, "n_texts": 2500,
                         "t2i_r1": 5.0, "ar": 5.0, "ms_per_query": 0.1, "notes": ""}],
               "published": published_rows("flickr8k")}
    assert table in results_markdown(results)
    assert "Published" not in results_markdown({**results, "published": None})


def test_the_frontier_marks_the_published_rows_on_the_test_panel_only():
    rows = json.loads(SMOKE_ROWS.read_text())["rows"]
    published = published_rows("flickr8k")
    fig = pareto_plot.plot_pareto_settings(rows, Figure(figsize=(13, 5.5)), published=published)
    test, full = fig.axes
    expected = sorted(r["t2i_r1"] for r in published["rows"])
    levels = sorted(float(line.get_ydata()[0]) for line in test.lines
                    if line.get_linestyle() == "--")
    assert levels == expected and not [line for line in full.lines if line.get_linestyle() == "--"]
    assert test.get_ylim()[1] > max(expected)  # the axes reach the best published row
    labels = {f"{r['paper']} ({r['image_features']}) {r['t2i_r1']:.1f}" for r in published["rows"]}
    assert labels <= {t.get_text() for t in test.texts}
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), matplotlib.text.Text.get_window_extent(t, renderer)) for t in test.texts
             if t.get_text() in labels | {r["method"] for r in rows}]
    for i, (a, box) in enumerate(boxes):
        for b, other in boxes[i + 1:]:
            assert not box.overlaps(other), f"{a!r} overlaps {b!r}"
    assert np.isfinite(test.get_xlim()).all()
