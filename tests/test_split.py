"""RetrievalSplit's bookkeeping: image subsets, text subsets, pooling, and bad input."""

import numpy as np
import pytest

from course_lib.data.split import RetrievalSplit, concatenate
from course_lib.data.synthetic import SyntheticConfig, make_benchmark


@pytest.fixture(scope="module")
def split():
    return make_benchmark(SyntheticConfig.smoke(n_train=20, n_val=10, n_test=12, n_pretrain=10,
                                                n_compositional=2), seed=2)["test"]


def test_subset_keeps_images_in_order_with_their_captions(split):
    sub = split.subset([5, 2])
    assert sub.image_ids == [split.image_ids[5], split.image_ids[2]]
    assert sub.captions == [split.captions[t] for t in split.img2txt()[5]] + \
                           [split.captions[t] for t in split.img2txt()[2]]
    assert np.array_equal(sub.regions, split.regions[[5, 2]])
    assert len(sub.meanings) == sub.n_texts and len(sub.scenes) == 2


def test_texts_subset_keeps_the_whole_gallery(split):
    picked = [7, 0, 33]
    sub = split.texts_subset(picked)
    assert sub.n_images == split.n_images and sub.image_ids == split.image_ids
    assert sub.captions == [split.captions[t] for t in picked]
    assert np.array_equal(sub.txt2img, split.txt2img[picked])
    assert np.array_equal(sub.meanings.a_shape, split.meanings.a_shape[picked])


def test_concatenate_offsets_txt2img(split):
    pooled = concatenate([split, split.subset([0, 1])], "pooled")
    assert pooled.n_images == split.n_images + 2
    assert np.array_equal(pooled.txt2img[split.n_texts:],
                          split.subset([0, 1]).txt2img + split.n_images)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="txt2img entries"):
        RetrievalSplit("x", ["a", "b"], [0], ["i0"])
    with pytest.raises(ValueError, match="outside"):
        RetrievalSplit("x", ["a"], [3], ["i0"])
    with pytest.raises(ValueError, match="regions has 2 rows"):
        RetrievalSplit("x", ["a"], [0], ["i0"], regions=np.zeros((2, 1, 1)))
