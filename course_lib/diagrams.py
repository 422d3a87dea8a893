"""One boxes-and-arrows diagram per family of methods. A spec: a title, boxes {key: (label, x, y,
kind)} with centres in a unit grid, and arrows (from, to, label or "")."""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

_KIND_COLOURS = {"image": "#dbe9f6", "text": "#fde2c8", "model": "#e4e4e4", "score": "#d9f0d3",
                 "index": "#efe1f5"}
_BOX_W, _BOX_H = 2.3, 0.72  # a box's size in grid units

DIAGRAMS = {
    "dual_encoder": {
        "title": "A dual encoder (VSE++): each side encoded alone, compared by one dot product",
        "boxes": {"image": ("image\n(regions or pixels)", 0, 1, "image"),
                  "f": ("image encoder f", 2.8, 1, "model"),
                  "v": ("image vector f(x)\n(computed offline)", 5.6, 1, "image"),
                  "caption": ("caption", 0, 0, "text"),
                  "g": ("text encoder g", 2.8, 0, "model"),
                  "u": ("text vector g(y)\n(one per query)", 5.6, 0, "text"),
                  "score": ("score = f(x) · g(y):\nunit vectors, a cosine", 8.4, 0.5, "score")},
        "arrows": [("image", "f", ""), ("f", "v", ""), ("caption", "g", ""), ("g", "u", ""),
                   ("v", "score", ""), ("u", "score", "")],
    },
    "cross_encoder": {
        "title": ("A single-stream cross-encoder (UNITER-style): one transformer reads caption and "
                  "image together"),
        "boxes": {"caption": ("caption words", 0, 1, "text"),
                  "image": ("image regions", 0, 0, "image"),
                  "sequence": ("one sequence\n[CLS] words [SEP] regions", 2.8, 0.5, "model"),
                  "transformer": ("transformer:\nevery word attends\nto every region", 5.6, 0.5,
                                  "model"),
                  "score": ("[CLS] output → score,\none pass per pair", 8.4, 0.5, "score")},
        "arrows": [("caption", "sequence", ""), ("image", "sequence", ""),
                   ("sequence", "transformer", ""), ("transformer", "score", "")],
    },
    "retrieve_rerank": {
        "title": ("Retrieve, then re-rank (LightningDOT): an index narrows N images to M, a "
                  "cross-encoder orders them"),
        # the re-ranker's score alone orders the M (TwoStageMethod: the scores are not fused)
        "boxes": {"gallery": ("gallery: N images", 0, 1, "image"),
                  "vectors": ("image vectors\n(offline)", 2.8, 1, "image"),
                  "query": ("query caption", 0, 0, "text"),
                  "encoder": ("text encoder\n([CLS] vector)", 2.8, 0, "model"),
                  "index": ("FAISS index search:\ntop M of N", 5.6, 0.5, "index"),
                  "rerank": ("cross-encoder re-scores\nthe M pairs (caption +\n"
                             "regions), one pass each", 8.4, 0.5, "model"),
                  "ranking": ("final ranking: the M\nby the cross-encoder's\nscore alone", 11.2,
                              0.5, "score")},
        "arrows": [("gallery", "vectors", ""), ("vectors", "index", ""), ("query", "encoder", ""),
                   ("encoder", "index", ""), ("index", "rerank", ""), ("rerank", "ranking", "")],
    },
    "ubert": {
        "title": "U-BERT: an intra-modal part to index, plus an inter-modal residual to re-rank",
        # BERT_cross reads the towers' cached token states: stage 2 runs only L_c layers
        "boxes": {"image": ("gallery: image regions", 0, 2.4, "image"),
                  "img_tower": ("BERT_img (intra-modal):\noffline, once per image", 2.8, 2.4,
                                "model"),
                  "img_states": ("cached per image: I_intra\n+ tokens for BERT_cross", 5.6, 2.4,
                                 "image"),
                  "caption": ("query caption", 0, 0, "text"),
                  "txt_tower": ("BERT_txt (intra-modal):\nonline, once per query", 2.8, 0, "model"),
                  "txt_states": ("the query's T_intra\n+ tokens for BERT_cross", 5.6, 0, "text"),
                  "s1": ("stage 1, indexed:\ns1 = cos(I_intra, T_intra),\nall N → top K", 5.6, 1.2,
                         "index"),
                  "cross": ("light BERT_cross (L_c layers)\nreads the K pairs' cached\ntokens → "
                            "I_inter, T_inter", 8.4, 1.2, "model"),
                  "s2": ("stage 2 re-orders the K by\ns2 = cos(α·I_intra + I_inter,\n"
                         "α·T_intra + T_inter)", 11.2, 1.2, "score")},
        "arrows": [("image", "img_tower", ""), ("img_tower", "img_states", ""),
                   ("caption", "txt_tower", ""), ("txt_tower", "txt_states", ""),
                   ("img_states", "s1", ""), ("txt_states", "s1", ""), ("s1", "cross", "top K"),
                   ("img_states", "cross", ""), ("txt_states", "cross", ""), ("cross", "s2", "")],
    },
    "hivlp": {
        "title": "HiVLP: early outputs of growing width, searched coarse to fine",
        # each level's EOL reads a block of the tower: one tower pass gives every level
        "boxes": {"image": ("image tower, offline: one\npass per image, its blocks\n"
                            "feed the levels' EOLs", 0, 1.1, "image"),
                  "text": ("text tower, online: one\npass per query, its blocks\n"
                           "feed the levels' EOLs", 11.2, 1.1, "text"),
                  "v1": ("image level 1:\nEOL_1 → narrow d_1", 2.8, 2.2, "image"),
                  "v2": ("image level 2:\nEOL_2 → wider d_2", 2.8, 1.1, "image"),
                  "v3": ("image level 3: EOL_3 of\nthe last block → widest d_3", 2.8, 0, "image"),
                  "t1": ("text level 1:\nEOL_1 → narrow d_1", 8.4, 2.2, "text"),
                  "t2": ("text level 2:\nEOL_2 → wider d_2", 8.4, 1.1, "text"),
                  "t3": ("text level 3: EOL_3 of\nthe last block → widest d_3", 8.4, 0, "text"),
                  "c1": ("level 1: S¹ at width d_1\nscores all N, keeps N2", 5.6, 2.2, "index"),
                  "c2": ("level 2: S² at d_2 re-scores\nthe N2, keeps N3", 5.6, 1.1, "score"),
                  "c3": ("level 3: S³ at d_3 orders\nthe N3 (final ranking)", 5.6, 0, "score")},
        "arrows": [("image", "v1", ""), ("image", "v2", ""), ("image", "v3", ""),
                   ("text", "t1", ""), ("text", "t2", ""), ("text", "t3", ""),
                   ("v1", "c1", ""), ("t1", "c1", ""), ("v2", "c2", ""), ("t2", "c2", ""),
                   ("v3", "c3", ""), ("t3", "c3", ""), ("c1", "c2", ""), ("c2", "c3", "")],
    },
    "fast_slow": {
        "title": ("Thinking Fast and Slow: a captioning likelihood teaches a dual encoder, then "
                  "re-ranks its top K"),
        # h is a summed log-likelihood (forward + backward decoders): eq. 9 adds β·f·g to it
        "boxes": {"slow": ("Slow: h(x, y), the caption's\nlog-likelihood given the image\n"
                           "(forward + backward)", 2.8, 1.4, "model"),
                  "fast": ("Fast: dual encoder f(x) · g(y),\nthe gallery's f(x) offline", 2.8, 0,
                           "model"),
                  "query": ("query caption", 0, 0, "text"),
                  "top": ("Fast's top K\nof N images", 5.6, 0, "index"),
                  "rescore": ("Slow re-scores the K from\ncached image keys / values:\n"
                              "h(x, y) + β · f(x) · g(y)", 8.7, 0, "score")},
        "arrows": [("slow", "fast", "distillation\n(training)"), ("query", "fast", ""),
                   ("fast", "top", ""), ("top", "rescore", ""), ("slow", "rescore", "")],
    },
}


def draw_method(name: str, ax=None):
    """The diagram of one family of methods, a key of DIAGRAMS: each box a rounded patch with its
    label (gid "box:KEY"), each arrow from one box's centre to the other's, clipped at the edges
    (gid "arrow:FROM->TO"). Returns the axes."""
    if name not in DIAGRAMS:
        raise KeyError(f"no diagram {name!r}; choose from {sorted(DIAGRAMS)}")
    spec = DIAGRAMS[name]
    boxes = spec["boxes"]
    _, xs, ys, _ = zip(*boxes.values(), strict=True)
    if ax is None:
        width, height = max(xs) - min(xs) + _BOX_W + 0.6, max(ys) - min(ys) + _BOX_H + 0.9
        _, ax = plt.subplots(figsize=(1.05 * width, 1.05 * height))
    patches = {}
    for key, (label, x, y, kind) in boxes.items():
        patches[key] = ax.add_patch(FancyBboxPatch(
            (x - _BOX_W / 2, y - _BOX_H / 2), _BOX_W, _BOX_H, boxstyle="round,pad=0.02",
            facecolor=_KIND_COLOURS[kind], edgecolor="dimgrey", linewidth=1, gid=f"box:{key}"))
        ax.text(x, y, label, ha="center", va="center", fontsize=8, gid=f"label:{key}")
    for start, end, label in spec["arrows"]:
        (_, x0, y0, _), (_, x1, y1, _) = boxes[start], boxes[end]
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), gid=f"arrow:{start}->{end}",
                    arrowprops=dict(arrowstyle="-|>", color="black", lw=1, patchA=patches[start],
                                    patchB=patches[end], shrinkA=2, shrinkB=2))
        if label:  # beside a vertical arrow, above any other
            upright = abs(x1 - x0) < abs(y1 - y0)
            x, y = (x0 + x1) / 2 + (0.1 if upright else 0), (y0 + y1) / 2 + (0 if upright else 0.1)
            ax.text(x, y, label, ha="left" if upright else "center", fontsize=7, color="dimgrey",
                    va="center" if upright else "bottom", gid=f"arrow-label:{start}->{end}")
    ax.set_xlim(min(xs) - _BOX_W / 2 - 0.3, max(xs) + _BOX_W / 2 + 0.3)
    ax.set_ylim(min(ys) - _BOX_H / 2 - 0.3, max(ys) + _BOX_H / 2 + 0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(textwrap.fill(spec["title"], 100), fontsize=10)
    return ax
