"""The course's figures draw what they claim: one panel per scene, one box per real region,
one point per timed method and a line for the untimed oracle."""

import textwrap

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from course_lib import diagrams, pareto_plot, viz  # noqa: E402
from course_lib.core.timing import TimingResult  # noqa: E402
from course_lib.data.synthetic import SyntheticConfig, make_benchmark  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return make_benchmark(SyntheticConfig.smoke(n_train=24, n_val=12, n_test=12, n_pretrain=12,
                                                n_compositional=4), seed=1)


def test_show_scenes_draws_each_scene_with_its_captions(bench):
    split = bench["test"]
    fig = viz.show_scenes(split, [0, 3, 5], cols=2, n_captions=2)
    drawn = [ax for ax in fig.axes if ax.images]
    assert len(drawn) == 3
    first_text = drawn[0].texts[0].get_text().splitlines()
    assert first_text[0] == textwrap.shorten(split.captions[split.img2txt()[0][0]], 64)
    assert len(first_text) == 2
    plt.close(fig)


def test_draw_boxes_draws_one_box_per_real_region(bench):
    split = bench["test"]
    for index in range(3):
        ax = viz.draw_boxes(split, index)
        assert len(ax.patches) == int(split.region_mask[index].sum())
        plt.close(ax.figure)


def test_show_twins_pairs_scene_and_twin(bench):
    comp = bench["compositional"]
    fig = viz.show_twins(comp, [(0, int(comp.info["twin_of"][0]))])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("scene") and titles[1].startswith("twin")
    plt.close(fig)


def test_pareto_plots_timed_methods_and_a_line_for_the_oracle():
    rows = [{"method": "oracle", "setting": "test", "t2i_r1": 90.0, "ms_per_query": None},
            {"method": "fast", "setting": "test", "t2i_r1": 20.0, "ms_per_query": 0.1},
            {"method": "slow", "setting": "test", "t2i_r1": 60.0, "ms_per_query": 30.0,
             "ms_measured": False},
            {"method": "slow", "setting": "full", "t2i_r1": 10.0, "ms_per_query": 300.0}]
    ax = pareto_plot.plot_pareto(rows, setting="test")
    points = np.concatenate([c.get_offsets() for c in ax.collections])
    assert sorted(points[:, 0].tolist()) == [0.1, 30.0]
    filled = [len(c.get_facecolors()) > 0 and c.get_facecolors()[0][3] > 0 for c in ax.collections]
    assert filled == [True, False]  # fast measured: filled; slow extrapolated: hollow
    # the axes fit the methods: the oracle, far above them, is marked at the top
    # edge, not drawn as a line
    assert ax.get_ylim()[1] < 90 and any(t.get_text().startswith("oracle 90.0") for t in ax.texts)
    assert not any(np.allclose(line.get_ydata(), 90.0) for line in ax.lines)
    assert ax.get_xscale() == "log"
    plt.close(ax.figure)
    # between the methods: a line
    within = [{**rows[0], "method": "bag-of-objects", "t2i_r1": 40.0}] + rows[1:]
    ax = pareto_plot.plot_pareto(within, setting="test")
    assert any(np.allclose(line.get_ydata(), 40.0) and "reference" in line.get_label()
               for line in ax.lines)
    plt.close(ax.figure)


def test_plot_timings_one_box_per_result():
    results = {"a": TimingResult.from_times([1.0, 2.0, 3.0], "cpu"),
               "b": TimingResult.from_times([10.0, 11.0], "cpu")}
    ax = viz.plot_timings(results)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"]
    # issue 13: a linear axis from 0, so a cold call 10x a warm one looks 10x as
    # high, not 1.1x on a log axis
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 11.0
    assert [t.get_text() for t in ax.texts] == ["2 ms", "10.5 ms"]
    plt.close(ax.figure)


def test_draw_boxes_labels_stay_inside_the_image(bench):
    split = bench["test"]
    for index in range(6):
        fig, ax = plt.subplots(figsize=(3, 3))
        labels = [f"{r}: a long region name" for r in range(split.region_mask.shape[1])]
        viz.draw_boxes(split, index, ax=ax, labels=labels)
        fig.canvas.draw()
        inside = ax.get_window_extent()
        assert len(ax.texts) == int(split.region_mask[index].sum())
        for text in ax.texts:
            box = text.get_window_extent()
            assert box.x0 >= inside.x0 - 1 and box.x1 <= inside.x1 + 1, text.get_text()
            assert box.y0 >= inside.y0 - 1 and box.y1 <= inside.y1 + 1, text.get_text()
        plt.close(fig)


def test_a_split_without_pixels_is_a_clear_error(bench):
    split = bench["test"]
    no_pixels = type(split)(name="x", captions=split.captions, txt2img=split.txt2img,
                            image_ids=split.image_ids)
    with pytest.raises(ValueError, match="no pixels"):
        viz.show_scenes(no_pixels, [0])


def test_show_retrieval_frames_only_the_true_image_in_red(bench):
    split = bench["test"]
    ranked = [4, 2, 7, 0, 9, 1, 3]
    fig = viz.show_retrieval(split, split.captions[10], ranked, true_image=7, cols=5)
    drawn = [ax for ax in fig.axes if ax.images]
    assert len(drawn) == len(ranked) and len(fig.axes) == 10  # 2 rows of 5, 3 panels left empty
    assert [ax.get_title().split(" ")[1] for ax in drawn] == [split.image_ids[i] for i in ranked]
    red = [ax for ax in drawn
           if ax.spines["top"].get_edgecolor() == matplotlib.colors.to_rgba("red")]
    assert red == [drawn[2]] and "(true)" in drawn[2].get_title()
    assert split.captions[10] in fig._suptitle.get_text()
    plt.close(fig)
    fig = viz.show_retrieval(split, "a query", ranked[:3], true_image=11)
    assert "not in this list" in fig._suptitle.get_text()
    plt.close(fig)


def test_pareto_draws_the_front_of_the_naive_dominance_loop():
    rows = [{"method": "oracle", "setting": "full", "t2i_r1": 80.0, "ms_per_query": None},
            {"method": "a", "setting": "full", "t2i_r1": 10.0, "ms_per_query": 1.0},
            # dominated by a
            {"method": "b", "setting": "full", "t2i_r1": 8.0, "ms_per_query": 2.0},
            {"method": "c", "setting": "full", "t2i_r1": 30.0, "ms_per_query": 5.0},
            # dominated by c
            {"method": "d", "setting": "full", "t2i_r1": 30.0, "ms_per_query": 50.0},
            {"method": "e", "setting": "full", "t2i_r1": 40.0, "ms_per_query": 100.0}]
    ax = pareto_plot.plot_pareto(rows, setting="full")
    timed = [r for r in rows if r["ms_per_query"]]
    naive = [r for r in timed
             if not any(q["ms_per_query"] <= r["ms_per_query"] and q["t2i_r1"] >= r["t2i_r1"]
                        and q is not r for q in timed)]
    (front,) = [line for line in ax.lines if line.get_label() == "Pareto front"]
    assert list(front.get_xdata()) == [r["ms_per_query"] for r in naive] == [1.0, 5.0, 100.0]
    assert list(front.get_ydata()) == [r["t2i_r1"] for r in naive]
    assert (sorted(t.get_text() for t in ax.texts if not t.get_text().startswith("oracle"))
            == ["a", "b", "c", "d", "e"])
    # at the edge
    assert ax.get_ylim()[1] < 80 and any("oracle 80.0 (ceiling)" in t.get_text() for t in ax.texts)
    plt.close(ax.figure)


def test_pareto_settings_one_panel_per_setting_and_one_colour_per_method():
    rows = [{"method": m, "setting": s, "t2i_r1": r, "ms_per_query": ms}
            for s in ("test", "full") for m, r, ms in (("fast", 5.0, 0.1), ("slow", 9.0, 10.0))]
    fig = pareto_plot.plot_pareto_settings(rows, settings=("test", "full"))
    assert ([ax.get_title() for ax in fig.axes]
            == ["accuracy vs latency (test)", "accuracy vs latency (full)"])
    colours = [[tuple(c.get_facecolors()[0]) for c in ax.collections] for ax in fig.axes]
    assert colours[0] == colours[1] and colours[0][0] != colours[0][1]
    plt.close(fig)


def _label_boxes(fig, names):
    """Per panel: (label text, display box, its marker's display centre, every marker's centre)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = []
    for ax in fig.axes:
        labels = [t for t in ax.texts if t.get_text() in names]  # the method labels
        centres = (ax.transData.transform(np.array([t.xy for t in labels])) if labels
                   else np.zeros((0, 2)))
        # Text's own extent: an Annotation's includes its leader line
        panels.append([(t.get_text(), Text.get_window_extent(t, renderer), centres[i], centres)
                       for i, t in enumerate(labels)])
    return panels


def _distance(box, point):
    """Distance from a point to the nearest edge of a box (0 inside it)."""
    dx = max(box.x0 - point[0], 0, point[0] - box.x1)
    dy = max(box.y0 - point[1], 0, point[1] - box.y1)
    return np.hypot(dx, dy)


def test_pareto_labels_never_overlap_and_sit_nearest_their_own_marker():
    # the 18 methods of a real smoke run, in tight clusters (two markers 7 px apart): labels used to
    # collide and sit on the wrong dot ("ubert@20" on lightningdot+rerank@20's)
    import json
    from pathlib import Path

    from matplotlib.figure import Figure

    rows_file = Path(__file__).parent / "data" / "pareto_rows_smoke_run.json"
    results = json.loads(rows_file.read_text())
    names = {r["method"] for r in results["rows"] if r.get("ms_per_query")}
    fig = pareto_plot.plot_pareto_settings(results["rows"], Figure(figsize=(13, 5.5)))
    for panel in _label_boxes(fig, names):
        assert len(panel) == len(names) == 18
        for i, (label, box, own, centres) in enumerate(panel):
            for other_label, other, _, _ in panel[i + 1:]:
                assert not box.overlaps(other), f"{label!r} overlaps {other_label!r}"
            to_nearest, to_own = min(_distance(box, c) for c in centres), _distance(box, own)
            assert to_nearest == pytest.approx(to_own), f"{label!r} sits nearer another marker"


def test_training_curves_one_panel_per_model_with_its_best_val_point_ringed():
    curves = {"a": {"step": [10, 20, 30], "val_r1": [4.0, 9.0, 6.0], "train_r1": [5.0, 12.0, 20.0]},
              # a stage without a train curve
              "b": {"step": [100], "val_r1": [2.0], "train_r1": [None]},
              "c": {"step": [1, 2], "val_r1": [1.0, 3.0], "train_r1": [1.0, 4.0]}}
    fig = viz.plot_training_curves(curves, cols=2)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["a", "b", "c"] and len(fig.axes) == 4
    val, train, best = visible[0].get_lines()
    assert list(val.get_ydata()) == [4.0, 9.0, 6.0] and list(train.get_ydata()) == [5.0, 12.0, 20.0]
    assert (list(best.get_xdata()), list(best.get_ydata())) == ([20], [9.0])
    assert len(visible[1].get_lines()) == 2  # val and its best point only
    with pytest.raises(ValueError, match="no curves"):
        viz.plot_training_curves({})


def test_learning_curve_draws_val_and_train_against_cpu_seconds():
    from course_lib.core.history import History

    history = History([{"step": 10, "loss": 1.0},
                       {"step": 10, "eval": True, "cpu_seconds": 5.0, "val_t2i_r1": 3.0,
                        "train_t2i_r1": 4.0},
                       {"step": 20, "eval": True, "cpu_seconds": 9.0, "val_t2i_r1": 7.0,
                        "train_t2i_r1": 11.0}])
    ax = viz.plot_learning_curve({"run": history})
    val, train = ax.get_lines()
    assert list(val.get_xdata()) == [5.0, 9.0] and list(val.get_ydata()) == [3.0, 7.0]
    assert list(train.get_ydata()) == [4.0, 11.0] and train.get_color() == val.get_color()
    assert ax.get_xlabel() == "training CPU-seconds"
    with pytest.raises(ValueError, match="learning_curve_splits"):
        viz.plot_learning_curve({"untracked": History([{"step": 1, "eval": True, "t2i_r1": 2.0}])})
    plt.close("all")


@pytest.mark.parametrize("name", sorted(diagrams.DIAGRAMS))
def test_each_method_diagram_draws_its_labelled_boxes_and_arrows_and_renders(name):
    import io

    from matplotlib.patches import FancyBboxPatch

    spec = diagrams.DIAGRAMS[name]
    ax = diagrams.draw_method(name)
    boxes = {p.get_gid()[4:]: p for p in ax.patches
             if isinstance(p, FancyBboxPatch) and p.get_gid()}
    assert set(boxes) == set(spec["boxes"])
    labels = {t.get_gid()[6:]: t.get_text() for t in ax.texts
              if (t.get_gid() or "").startswith("label:")}
    assert labels == {key: label for key, (label, *_) in spec["boxes"].items()}
    arrows = {t.get_gid(): t for t in ax.texts if (t.get_gid() or "").startswith("arrow:")}
    assert set(arrows) == {f"arrow:{a}->{b}" for a, b, _ in spec["arrows"]}
    for a, b, _ in spec["arrows"]:  # each arrow runs from its source box's centre to its target's
        (_, x0, y0, _), (_, x1, y1, _) = spec["boxes"][a], spec["boxes"][b]
        arrow = arrows[f"arrow:{a}->{b}"]
        assert arrow.xy == (x1, y1) and arrow.xyann == (x0, y0)
        assert boxes[a].contains_point(ax.transData.transform((x0, y0)))
    png = io.BytesIO()
    ax.figure.savefig(png, format="png")
    assert png.getvalue().startswith(b"\x89PNG\r\n\x1a\n") and len(png.getvalue()) > 5_000
    plt.close(ax.figure)


@pytest.mark.parametrize("name", sorted(diagrams.DIAGRAMS))
def test_no_arrow_of_a_diagram_runs_through_another_box(name):
    spec = diagrams.DIAGRAMS[name]
    half_w, half_h = diagrams._BOX_W / 2 + 0.05, diagrams._BOX_H / 2 + 0.05
    for a, b, _ in spec["arrows"]:
        (_, x0, y0, _), (_, x1, y1, _) = spec["boxes"][a], spec["boxes"][b]
        t = np.linspace(0, 1, 500)
        xs, ys = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
        for key, (_, x, y, _) in spec["boxes"].items():
            if key not in (a, b):
                crosses = ((abs(xs - x) <= half_w) & (abs(ys - y) <= half_h)).any()
                assert not crosses, f"{a}->{b} crosses {key}"


def test_an_unknown_diagram_names_the_known_ones():
    with pytest.raises(KeyError, match="dual_encoder"):
        diagrams.draw_method("clip")


def _inputs(spec: dict) -> dict:
    """{box: the boxes with an arrow into it} of a diagram spec."""
    inputs = {key: set() for key in spec["boxes"]}
    for start, end, _ in spec["arrows"]:
        inputs[end].add(start)
    return inputs


def test_ubert_cross_encoder_reads_the_cached_tower_states_not_the_raw_inputs():
    # UBERTStates: one tower pass caches each side's intra vector and the tokens BERT_cross reads
    spec = diagrams.DIAGRAMS["ubert"]
    inputs = _inputs(spec)
    raw = {key for key, feeding in inputs.items() if not feeding}
    assert raw == {"image", "caption"}
    assert inputs["cross"] == {"img_states", "txt_states", "s1"}  # the states of stage 1's top K
    assert inputs["img_states"] == {"img_tower"} and inputs["txt_states"] == {"txt_tower"}
    assert inputs["img_tower"] == {"image"} and inputs["txt_tower"] == {"caption"}
    assert inputs["s1"] == {"img_states", "txt_states"} and inputs["s2"] == {"cross"}
    assert "offline" in spec["boxes"]["img_tower"][0] and "online" in spec["boxes"]["txt_tower"][0]


def test_hivlp_levels_read_their_tower_and_the_cascade_runs_coarse_to_fine():
    # one tower pass gives every level (HiVLP.image_levels): no level is computed from another
    inputs = _inputs(diagrams.DIAGRAMS["hivlp"])
    for level in (1, 2, 3):
        assert inputs[f"v{level}"] == {"image"} and inputs[f"t{level}"] == {"text"}
    assert inputs["c1"] == {"v1", "t1"}
    assert inputs["c2"] == {"v2", "t2", "c1"} and inputs["c3"] == {"v3", "t3", "c2"}
