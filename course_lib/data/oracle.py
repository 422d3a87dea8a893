"""The oracle ceiling: the Bayes-optimal ranking under the generator's own caption likelihood
(course_lib.data.likelihood), the best any model seeing only captions and images can do:
t2i ranks images by L[t, i] = P(caption t | scene i), i2t captions by the posterior
L[t, i] / sum_j L[t, j], ties broken at random. It beats captions.truth_ceiling in expectation;
a tiny realised gallery can show t2i slightly below it."""

import numpy as np

from course_lib.core.metrics import hit_probability

from .likelihood import _iter_sparse, _snap, compositional_likelihood


def bayes_recall(rows, cols, values, txt2img, n_images: int, ks=(1, 5, 10), *,
                 query_texts=None, query_images=None) -> dict[str, float]:
    """Expected R@K (percent) of the Bayes ranking from a likelihood's nonzero entries; images
    without captions are skipped in i2t. query_texts / query_images: average over these only."""
    txt2img = np.asarray(txt2img, dtype=np.int64)
    T, N = len(txt2img), n_images
    own = cols == txt2img[rows]
    # t2i: the own image against the others; zero-likelihood images tie at the end
    v_own = np.zeros(T)
    v_own[rows[own]] = values[own]
    per_row = np.bincount(rows, minlength=T)
    ahead = np.where(v_own > 0, np.bincount(rows, weights=values > v_own[rows], minlength=T),
                     per_row)
    tied = np.where(v_own > 0, np.bincount(rows, weights=values == v_own[rows], minlength=T),
                    N - per_row)
    # i2t: posterior over origins; an image's best own caption against every caption
    post = _snap(values / np.bincount(rows, weights=values, minlength=T)[rows])
    p_own = np.zeros(T)
    p_own[rows[own]] = post[own]
    best = np.full(N, -1.0)
    np.maximum.at(best, txt2img, p_own)
    good = np.bincount(txt2img, weights=p_own == best[txt2img], minlength=N)
    per_col = np.bincount(cols, minlength=N)
    ahead_i = np.where(best > 0, np.bincount(cols, weights=post > best[cols], minlength=N),
                       per_col)
    tied_i = np.where(best > 0, np.bincount(cols, weights=post == best[cols], minlength=N),
                      T - per_col)
    has_text = np.bincount(txt2img, minlength=N) > 0
    if query_images is not None:
        has_text &= np.isin(np.arange(N), query_images)
    text_queries = np.arange(T) if query_texts is None else np.asarray(query_texts, dtype=np.int64)
    out = {}
    for k in ks:
        t2i = hit_probability(tied, 1, k - ahead)[text_queries]
        i2t = hit_probability(tied_i, good, k - ahead_i)[has_text]
        out[f"t2i_r{k}"] = 100.0 * float(t2i.mean()) if len(t2i) else float("nan")
        out[f"i2t_r{k}"] = 100.0 * float(i2t.mean()) if len(i2t) else float("nan")
    return out


def oracle_ceiling(split, ks=(1, 5, 10)) -> dict[str, float]:
    """The best expected R@K (percent) any model could reach on a synthetic split (docs/data.md):
    the Bayes ranking's, under the compositional likelihood for a whole compositional gallery."""
    config, twin_of, pairs = (split.info.get(k) for k in ("config", "twin_of", "swapped_objects"))
    if twin_of is None or pairs is None or not len(twin_of) == 2 * len(pairs) == split.n_images:
        parts = [p[2:] for p in _iter_sparse(split.meanings, split.scenes, config)]
        rows, cols, values = (np.concatenate([p[i] for p in parts]) for i in range(3))
    else:
        swapped = np.repeat(np.asarray(pairs), 2, axis=0)  # (N, 2) per image
        L = compositional_likelihood(split.meanings, split.scenes, np.asarray(twin_of), swapped,
                                     config)
        rows, cols = np.nonzero(L)
        values = L[rows, cols]
    return bayes_recall(rows, cols, values, split.txt2img, split.n_images, ks,
                        query_texts=split.query_texts, query_images=split.query_images)
