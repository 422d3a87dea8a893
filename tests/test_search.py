"""Free-text photo search (course_lib.search): a typed caption answered by fitted Rankers, checked
against the same Rankers' own ranking of a caption the split already holds."""

import matplotlib
import pytest

matplotlib.use("Agg")

from course_lib import search  # noqa: E402
from course_lib.core.shipped import without_shipped_models  # noqa: E402
from course_lib.methods.cross_encoder.method import CrossEncoderMethod  # noqa: E402
from course_lib.methods.cross_encoder.model import CrossEncoderConfig  # noqa: E402
from course_lib.methods.rerank import TwoStageMethod  # noqa: E402
from course_lib.methods.scan.method import SCANMethod  # noqa: E402
from course_lib.methods.scan.model import SCANConfig  # noqa: E402
from course_lib.methods.vsepp import VsePPConfig, VsePPMethod  # noqa: E402

BENCH_SIZES = dict(n_train=120, n_val=8, n_test=12, n_pretrain=2, n_compositional=1)


@pytest.fixture(scope="module")
def rankers(bench, tok, one_thread, tmp_path_factory):
    """A dual encoder, and a cross-encoder re-ranking its top 6 over it; both fitted briefly."""
    cache = tmp_path_factory.mktemp("checkpoints")
    with without_shipped_models():  # a few steps of training, not the shipped models
        dual = VsePPMethod(VsePPConfig.smoke(max_steps=3),
                           progress=False).fit(bench, tok, cache_dir=cache)
        towers = SCANMethod(SCANConfig.smoke(max_steps=3), progress=False)
        reranker = CrossEncoderMethod(CrossEncoderConfig.smoke(max_steps=3), towers=towers,
                                      progress=False)
        reranker.fit(bench, tok, cache_dir=cache)
    return [dual, TwoStageMethod(dual, reranker, top_m=6)]


def test_a_typed_caption_gets_the_photos_its_caption_in_the_split_gets(bench, rankers):
    test = bench["test"]
    for q in (0, 7, test.n_texts - 1):
        found = search.search_photos(rankers, test, test.captions[q], top_k=5, repeats=2)
        assert [r.method for r in found] == [r.name for r in rankers]
        for ranker, result in zip(rankers, found, strict=True):
            expected, _ = ranker.rank(test, "t2i", 5, [q])  # (1, 5): the split's own query path
            assert result.indices.tolist() == expected[0].tolist(), ranker.name
            assert 0 < result.ms_p25 <= result.ms <= result.ms_p75


def test_the_search_split_shares_the_photos_and_holds_only_the_caption(bench):
    test = bench["test"]
    split = search.caption_split(test, "  a red cube left of a ball ")
    assert split.captions == ["a red cube left of a ball"] and split.n_images == test.n_images
    # shared, not copied
    assert split.regions is test.regions and split.region_mask is test.region_mask
    for empty in ("", "   ", None):
        with pytest.raises(ValueError, match="type a caption"):
            search.caption_split(test, empty)


def test_show_search_draws_one_row_per_method_titled_with_its_ms(bench, rankers):
    import matplotlib.pyplot as plt

    fig = search.show_search(rankers, bench["test"], "a small blue sphere", top_k=4)
    rows = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert len(fig.axes) == 2 * 4 and len(rows) == 2
    assert all(text.startswith(name + ":") and " ms (IQR " in text
               for text, name in zip(rows, ["vsepp", rankers[1].name], strict=True))
    plt.close(fig)


def test_the_search_box_searches_each_caption_typed(bench, rankers, monkeypatch):
    pytest.importorskip("ipywidgets")
    asked = []
    monkeypatch.setattr(search, "show_search",
                        lambda rankers, gallery, caption, top_k: asked.append(caption))
    box = search.search_box(rankers, bench["test"], "a green cube")
    text = box.children[0]
    assert text.value == "a green cube" and asked == []  # nothing searched until a caption is typed
    text.value = "two spheres"
    assert asked == ["two spheres"]
