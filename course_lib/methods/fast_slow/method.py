"""Training Fast & Slow (Miech et al. 2021) and its benchmark methods.

    slow            L_CA = -sum_i h(x_i, y_i) on positive pairs only (§3.1; averaged over the
                    batch here), no negatives, no horizontal flips (captions name left and right)
    fast            the NCE dual encoder with eq. 4 (`losses.joint_nce_loss`), its CNN from the
                    cached pixel stem (FastConfig.image_init)
    fast-distilled  eq. 8: L_distill + alpha * L_DE, the frozen Slow teacher's h / tau against the
                    student's dot products / tau over candidate images per caption (`distill`)
    fast_slow@K     eq. 9: the distilled Fast model ranks the gallery, its top K are re-scored by
                    h(x, y) + beta * f(x)^T g(y) (`rerank.Cascade` with `weighted_sum([beta, 1])`)

The paper does not say how it paid the teacher's decoder passes (docs/tuning_notes.md, "Fast & Slow,
distillation"). Ours: the student starts from the trained `fast` model and takes distill_steps of
eq. 8, the teacher scoring 16 captions x 16 candidates a step (the paper's: distill_start=scratch).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from course_lib.core.losses import batch_scores, joint_nce_loss
from course_lib.core.serving import QueryTokenizer
from course_lib.core.settings import seed_everything
from course_lib.core.stages import Stage, config_fields
from course_lib.core.tokens import SpecialTokens
from course_lib.data.synthetic import with_fresh_scenes
from course_lib.methods.base import DualEncoderMethod, PairwiseMethod, fit_pairs
from course_lib.methods.encoding import retrieval_evaluator, similarity
from course_lib.methods.fast_slow.distill import distill_loss, mine_candidates, mined_distill_loss
from course_lib.methods.fast_slow.model import FastConfig, FastModel, SlowConfig, SlowModel
from course_lib.methods.fast_slow.scoring import SlowStates, compute_states, score_cached_pairs
from course_lib.methods.pixel_stem import StartsFromPixelStem, load_stem_backbone
from course_lib.methods.registry import register_method
from course_lib.methods.rerank import Cascade, weighted_sum

# eq. 9's beta (paper: > 0, not given); 0: plain re-ranking
BETA = 0.0  # docs/tuning_notes.md, "Fast & Slow, re-ranking with beta"
TOP_KS = (10, 50)  # the paper's K (Table 4)
# the fields only distillation (eq. 8) reads
DISTILL_FIELDS = ("tau", "alpha", "distill_batch_size", "distill_steps", "distill_lr",
                  "distill_start", "distill_candidates", "distill_top_k")


# ----------------------------------------------------------------------------- training
def caption_loss(model: SlowModel, batch: dict, step: int = 0) -> dict:
    """L_CA / B: minus the mean h of the batch's positive pairs; also the per-word NLL, to read."""
    h = model(batch)  # (B,)
    words = (batch["attention_mask"].sum(1) - 2).clamp(min=1).float()  # (B,) words per caption
    return {"loss": -h.mean(), "nll_per_word": (-h / (2 * words)).mean()}


def nce_loss(model: FastModel, batch: dict, step: int = 0) -> torch.Tensor:
    """Eq. 4 on the batch's (B, B) dot products."""
    return joint_nce_loss(batch_scores(*model(batch)))


def train_slow(bench: dict, tokenizer, config: SlowConfig | None = None, *, checkpoint_path=None,
               stem_checkpoint=None, progress: bool = True, device: str | None = None):
    """Train the Slow captioner (from the pixel stem if image_init says) -> (model, history)."""
    c = config or SlowConfig()
    seed_everything(c.seed)
    model = new_model(SlowModel, bench, tokenizer, c)
    if c.image_init == "pixel_stem":
        load_stem_backbone(model.visual.backbone, bench, c, checkpoint_path=stem_checkpoint,
                           progress=progress, device=device)
    history = fit_pairs(model, caption_loss, bench["train"], tokenizer, c, modality=c.image_input,
                        max_text_length=c.max_text_length, log_every=25, progress=progress,
                        checkpoint_path=checkpoint_path, device=device)
    return model.eval(), history


def new_model(model_class, bench: dict, tokenizer, config):
    """A fresh SlowModel or FastModel of the vocabulary and bench["train"]'s image input."""
    regions = config.image_input == "regions"
    if regions and not bench["train"].has_regions:
        raise ValueError("image_input='regions' needs region features: load a feature folder "
                         "(course_lib.data.features.load_feature_bench)")
    region_dim = bench["train"].regions.shape[-1] if regions else None
    return model_class(len(tokenizer), config, SpecialTokens.of(tokenizer), region_dim)


def undistilled(config: FastConfig) -> FastConfig:
    """The config of the plain Fast model a distilled one starts from (its eq. 4 steps)."""
    return dataclasses.replace(config, distill=False)


def initial_fast_model(bench: dict, tokenizer, config: FastConfig, *, stem_checkpoint=None,
                       with_stem: bool = True, progress: bool = True,
                       device: str | None = None) -> FastModel:
    """The Fast model eq. 4 starts from: seeded weights (+ the pixel stem's CNN if with_stem)."""
    seed_everything(config.seed)
    model = new_model(FastModel, bench, tokenizer, config)
    if with_stem and config.image_init == "pixel_stem":
        load_stem_backbone(model.backbone, bench, config, checkpoint_path=stem_checkpoint,
                           progress=progress, device=device)
    return model


def train_fast(bench: dict, tokenizer, config: FastConfig | None = None, *,
               teacher: SlowModel | None = None, init: FastModel | None = None,
               checkpoint_path=None, stem_checkpoint=None, evaluate_on=None,
               eval_every: int | None = None, progress: bool = True, device: str | None = None):
    """Train Fast with eq. 4; with config.distill, continue from `init` (the plain model) for
    distill_steps of eq. 8, the teacher frozen -> (model.eval(), history)."""
    c = config or FastConfig()
    from_fast = c.distill and c.distill_start == "fast"
    if c.distill and (teacher is None or (from_fast and init is None)):
        raise ValueError("FastConfig(distill=True) needs the Slow teacher and "
                         "(distill_start='fast') the plain Fast model it starts from: "
                         "train_fast(..., teacher=slow_model, init=fast_model)")
    # distilled from the plain model: no stem, its weights come from `init`
    model = initial_fast_model(bench, tokenizer, c, stem_checkpoint=stem_checkpoint,
                               with_stem=not from_fast, progress=progress, device=device)
    evaluate = retrieval_evaluator(evaluate_on, lambda m, split: similarity(m, split, tokenizer))
    train = with_fresh_scenes(bench["train"], c.fresh_scenes)  # the training split, then fresh ones
    loss_fn, schedule = nce_loss, {}  # eq. 4 with the config's training fields
    if c.distill:
        if from_fast:
            model.load_state_dict(init.state_dict())
        teacher.requires_grad_(False).eval()  # frozen: eq. 8 trains f and g only
        if c.distill_candidates == "mined":  # the student's own top K of the training split, once
            train = bench["train"]  # (mining the fresh scenes too would cost more than the steps)
            candidates = mine_candidates(model, train, tokenizer, c.distill_top_k)  # (T, K)
            loss_fn, batch_size = mined_distill_loss(teacher, c, candidates, train), c.batch_size
        else:
            loss_fn, batch_size = distill_loss(teacher, c), c.distill_batch_size
        schedule = dict(batch_size=batch_size, max_steps=c.distill_steps, lr=c.distill_lr)
    history = fit_pairs(model, loss_fn, train, tokenizer, c, modality=c.image_input,
                        evaluate=evaluate, eval_every=eval_every, log_every=25, progress=progress,
                        checkpoint_path=checkpoint_path, device=device, **schedule)
    return model.eval(), history


# ----------------------------------------------------------------------------- methods
class SlowMethod(StartsFromPixelStem, PairwiseMethod):
    """Every (image, caption) pair scored by h(x, y) from the split's cached keys / values."""

    checkpoint_prefix = "slow"
    config_class = SlowConfig
    # pairs scored per direction (cost: docs/tuning_notes.md, "Fast & Slow, Slow")
    eval_pairs = (250_000, 20_000)
    every_pair_limit = 250_000  # every test pair: 5M a direction; `--every-pair` keeps the sample
    timed_sizes = ((250, 500, 1_000), (25, 50, 100))

    @property
    def notes(self) -> str:
        c = self.config
        tokens = ("grid cells with their boxes as tokens" if c.image_input == "regions" else
                  f"CNN + weighted-fusion upsampling to {c.visual_size}x{c.visual_size} tokens")
        return (f"Slow: {tokens}, forward + backward captioning decoders ({c.layers} x "
                f"{c.hidden}); h = summed log-likelihood, every pair")

    def build_model(self, bench, tokenizer) -> SlowModel:
        return new_model(SlowModel, bench, tokenizer, self.config)

    def starts_from_stem(self) -> bool:
        return self.config.image_init == "pixel_stem"

    def train(self, bench, tokenizer, checkpoint_path, cache_dir):
        stem = self.stem_checkpoint(bench, cache_dir)
        return train_slow(bench, tokenizer, self.config, checkpoint_path=checkpoint_path,
                          stem_checkpoint=stem, progress=self.progress)

    def states(self, split) -> SlowStates:
        """The split's keys / values and tokenised captions, once per split."""
        return self.cached_states(split, compute_states)

    def score_pairs(self, split, image_indices, text_indices) -> torch.Tensor:
        return score_cached_pairs(self._fitted(), self.states(split), image_indices, text_indices)

    def score_block(self, split, image_indices, text_indices) -> torch.Tensor:
        images, texts = np.asarray(image_indices), np.asarray(text_indices)
        pairs = self.score_pairs(split, np.tile(images, len(texts)), np.repeat(texts, len(images)))
        return pairs.view(len(texts), len(images)).T  # (n, m)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """One caption against every gallery image: its decoders on N cached-K/V pairs."""
        model, states = self._fitted(), self.states(split)
        tokenizer = QueryTokenizer(self.tokenizer, self.config.max_text_length)
        caption = split.captions[caption_index]
        gallery = torch.arange(split.n_images)

        def answer() -> np.ndarray:
            ids, mask = (torch.from_numpy(a) for a in tokenizer(caption))  # (1, T) each
            scored = SlowStates(states.kvs, ids, mask)
            h = score_cached_pairs(model, scored, gallery, torch.zeros_like(gallery))  # (N,)
            return torch.topk(h, min(top_k, len(h))).indices.numpy()

        return answer


class FastMethod(StartsFromPixelStem, DualEncoderMethod):
    """The Fast dual encoder (`fast`), or distilled (`fast-distilled`) from `teacher` (a SlowMethod)
    starting from `init` (the plain FastMethod)."""

    checkpoint_prefix = "fast"
    config_class = FastConfig

    def __init__(self, config: FastConfig | None = None, name: str = "fast",
                 teacher: SlowMethod | None = None, init: FastMethod | None = None,
                 progress: bool = True):
        super().__init__(config, name, progress)
        from_fast = self.config.distill and self.config.distill_start == "fast"
        if self.config.distill and (teacher is None or (from_fast and init is None)):
            raise ValueError("a distilled FastMethod needs teacher=SlowMethod(...) and "
                             "(distill_start='fast') init=FastMethod(...)")
        self.teacher = teacher if self.config.distill else None
        self.init = init if from_fast else None  # the plain model eq. 8 starts from

    @property
    def notes(self) -> str:
        c = self.config
        start = "eq. 4 NCE, then" if c.distill_start == "fast" else "from scratch,"
        over = (f"each caption's top {c.distill_top_k} images" if c.distill_candidates == "mined"
                else "the batch's images")
        how = (f"{start} {c.distill_steps} steps distilled from Slow over {over} (tau {c.tau:g}, "
               f"alpha {c.alpha:g}, B={c.distill_batch_size})" if c.distill else "eq. 4 NCE")
        image = {"pixels": "mean-pooled" if c.image_pool == "mean" else "flattened 4x4",
                 "regions": "mean-pooled grid cells,"}[c.image_input]
        text = {"bow": "bag of words", "gru": f"{c.text_layers}-layer bi-GRU",
                "transformer": f"{c.text_layers}-layer transformer"}[c.text_tower]
        return f"Fast: {image} CNN / {text}, dot product, {how}, FAISS IndexFlatIP"

    def starts_from_stem(self) -> bool:
        """From the stem, unless it is distilled from the plain model (which started from it)."""
        c = self.config
        return c.image_init == "pixel_stem" and not (c.distill and c.distill_start == "fast")

    def stage(self, bench: dict, tokenizer) -> Stage:
        """The config (a plain model's without DISTILL_FIELDS), data, teacher, init, stem."""
        without = () if self.config.distill else DISTILL_FIELDS
        return Stage(self.checkpoint_prefix, reads=config_fields(self.config, without=without),
                     data=bench["train"], vocabulary=tokenizer, version=self.format_version,
                     starts_from=(*(m and m.stage(bench, tokenizer)
                                    for m in (self.teacher, self.init)), self.stem_stage(bench)))

    def build_model(self, bench, tokenizer) -> FastModel:
        return new_model(FastModel, bench, tokenizer, self.config)

    def train(self, bench, tokenizer, checkpoint_path, cache_dir):
        for method in (self.teacher, self.init):  # both None unless distilled
            if method is not None and method.model is None:
                method.fit(bench, tokenizer, cache_dir)
        teacher, init = (method and method.model for method in (self.teacher, self.init))
        c, stem = self.config, self.stem_checkpoint(bench, cache_dir)
        steps = c.distill_steps if c.distill else c.max_steps
        return train_fast(bench, tokenizer, c, teacher=teacher, init=init, progress=self.progress,
                          checkpoint_path=checkpoint_path, stem_checkpoint=stem,
                          **self.learning_curve(bench, steps))


class FastSlowCascade(Cascade):
    """Eq. 9: `fast` keeps the top K, `slow` re-scores them by h(x, y) + beta * f(x)^T g(y)."""

    def __init__(self, fast: FastMethod, slow: SlowMethod, top_k: int, beta: float = BETA,
                 name: str | None = None):
        super().__init__([fast, slow], [top_k], combine=weighted_sum([beta, 1.0]),
                         name=name or f"fast_slow@{top_k}",
                         notes=(f"Fast & Slow: {fast.name} keeps the top {top_k}, re-scored by h + "
                                f"{beta:g} * f.g (Slow from cached gallery keys / values)"))
        self.fast, self.slow, self.beta = fast, slow, beta

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        self.slow.states(split)  # offline: the gallery's keys / values
        return super().query_fn(split, caption_index, top_k)


@register_method("slow", order=6.0)
def _slow(build) -> SlowMethod:
    return SlowMethod(build.config(SlowConfig))


@register_method("fast", order=6.1)
def _fast(build) -> FastMethod:
    return FastMethod(build.config(FastConfig))


@register_method("fast-distilled", order=6.2)
def _fast_distilled(build) -> FastMethod:
    fast = build.method("fast")
    return FastMethod(dataclasses.replace(fast.config, distill=True), name="fast-distilled",
                      teacher=build.method("slow"), init=fast)


for _order, _k in zip((6.3, 6.4), TOP_KS, strict=True):
    register_method(f"fast_slow@{_k}", order=_order)(lambda build, k=_k: FastSlowCascade(
        build.method("fast-distilled"), build.method("slow"), k))
