"""Train HiVLP and retrieve with it coarse to fine (§3.3-3.4): the benchmark's methods `hivlp` (the
cascade, N2 = 1000, N3 = 100 as the paper), `hivlp-flat` (the last level over every candidate),
`hivlp+rerank@20` (the paper's "+CM" with the cross-encoder), `hivlp-regions` (the region tower).

    model, history = train_hivlp(bench, tokenizer, HiVLPConfig(), checkpoint_path=...)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from course_lib.core.checkpoints import finished_checkpoint
from course_lib.core.retrieval import build_index, search
from course_lib.core.settings import seed_everything
from course_lib.data.datasets import CaptionDataset, ImageDataset, make_loader
from course_lib.data.split import RetrievalSplit
from course_lib.data.synthetic import with_fresh_scenes
from course_lib.methods.base import DualEncoderMethod, Ranker, fit_pairs
from course_lib.methods.encoding import encode_batches, retrieval_evaluator
from course_lib.methods.hivlp.model import HiVLP, HiVLPConfig, build_hivlp, logged_levels
from course_lib.methods.hivlp.search import SURVIVORS, coarse_to_fine_one
from course_lib.methods.pixel_stem import StartsFromPixelStem, load_stem_backbone
from course_lib.methods.queries import checked_pairs, query_indices
from course_lib.methods.registry import register_method
from course_lib.methods.rerank import Cascade

RERANK_TOP_M = 20  # "+CM": the cascade's top M re-scored by the cross-encoder


def hivlp_loss(model: HiVLP, batch: dict, step: int = 0) -> dict:
    """The Trainer's loss_fn: L_HRL + lrm_weight * L_LRM, every level's L_RL logged."""
    return model.loss(batch)


def last_level_loss(model: HiVLP, batch: dict, step: int = 0) -> dict:
    """An ablation's loss_fn (lesson 05): the last level's L_RL alone, every level's logged."""
    per_level, _ = model.level_losses(batch)
    return {"loss": per_level[-1], **logged_levels(per_level)}


# ----------------------------------------------------------------------------- cached levels
@dataclass
class HiVLPStates:
    """A split's level vectors: image[l] (N, d_l) and text[l] (T, d_l), on the CPU."""

    image: list
    text: list


def _encode_levels(model: HiVLP, loader, encode, progress: bool, desc: str) -> list[torch.Tensor]:
    parts = encode_batches(model, loader, lambda batch: [x.float().cpu() for x in encode(batch)],
                           progress=progress, desc=desc)  # [[(b, d_l)]]
    return [torch.cat(level) for level in zip(*parts, strict=True)]  # [(n, d_l)]


def compute_states(model: HiVLP, split, tokenizer, batch_size: int = 256,
                   progress: bool = False) -> HiVLPStates:
    """Every image's and caption's level vectors, one tower pass each (offline work)."""
    images = make_loader(ImageDataset(split, modality=model.modality,
                                      image_size=model.config.image_size), batch_size)
    texts = make_loader(CaptionDataset(split), batch_size, tokenizer=tokenizer)
    return HiVLPStates(_encode_levels(model, images, model.image_levels, progress, "image levels"),
                       _encode_levels(model, texts, model.text_levels, progress, "caption levels"))


# ----------------------------------------------------------------------------- training
def last_level_scores(model: HiVLP, split, tokenizer) -> torch.Tensor:
    """(N, T) scores of the last (widest) level over a whole split: the flat model, no cascade."""
    states = compute_states(model, split, tokenizer)
    return states.image[-1] @ states.text[-1].T  # (N, T)


def uses_pixel_stem(config: HiVLPConfig) -> bool:
    """Whether the image tower starts from the pre-trained pixel stem."""
    return config.image_input == "pixels" and config.stem == "pixel_stem"


def with_stem_grid(split, tower, batch_size: int = 512, progress: bool = False,
                   device: str | None = None) -> RetrievalSplit:
    """A copy of `split` whose regions are a frozen `StemGridTower`'s grid tokens (N, 16, C)."""
    loader = make_loader(ImageDataset(split, modality="pixels"), batch_size)
    parts = encode_batches(tower.backbone, loader,
                           lambda batch: tower.grid_tokens(batch["pixels"]).float().cpu(), device,
                           progress, "stem grid")  # [(b, 16, C)]
    tokens = torch.cat(parts).numpy()  # (N, 16, C), their boxes (N, 16, 7)
    return RetrievalSplit(name=f"{split.name}:stem-grid", captions=split.captions,
                          txt2img=split.txt2img, image_ids=split.image_ids, regions=tokens,
                          boxes=np.tile(tower.boxes.cpu().numpy(), (len(tokens), 1, 1)),
                          region_mask=np.ones(tokens.shape[:2], dtype=bool), info=dict(split.info))


def train_hivlp(bench: dict, tokenizer, config: HiVLPConfig | None = None, *, checkpoint_path=None,
                stem_checkpoint=None, evaluate_on=None, eval_every: int | None = None,
                progress: bool = True, device: str | None = None,
                loss_fn=hivlp_loss) -> tuple[HiVLP, object]:
    """Train with loss_fn (stem="pixel_stem": from the pixel stem) -> (model.eval(), History)."""
    c = config or HiVLPConfig()
    seed_everything(c.seed)
    model = build_hivlp(c, bench["train"], tokenizer)
    if uses_pixel_stem(c):  # (the Trainer re-seeds: the same training, stem trained here or loaded)
        load_stem_backbone(model.image_tower.backbone, bench, c, checkpoint_path=stem_checkpoint,
                           progress=progress, device=device)
    evaluate = retrieval_evaluator(evaluate_on, lambda m, one: last_level_scores(m, one, tokenizer))
    train, modality = bench["train"], c.image_input
    if not finished_checkpoint(checkpoint_path, c.max_steps):  # (a finished one loads: no data)
        train = with_fresh_scenes(train, c.fresh_scenes)  # the training split, then fresh scenes
        if uses_pixel_stem(c) and c.freeze_stem:  # the frozen stem once per image, not per step
            train = with_stem_grid(train, model.image_tower, progress=progress, device=device)
            modality = "regions"
    history = fit_pairs(model, loss_fn, train, tokenizer, c, modality=modality,
                        image_size=c.image_size, max_text_length=c.max_text_length,
                        evaluate=evaluate, eval_every=eval_every, progress=progress, device=device,
                        log_every=max(1, c.max_steps // 100), checkpoint_path=checkpoint_path)
    return model.eval(), history


# ----------------------------------------------------------------------------- methods
class HiVLPMethod(StartsFromPixelStem, DualEncoderMethod):
    """The flat method (`hivlp-flat`); `level(l)`: one level as a cascade stage."""

    checkpoint_prefix = "hivlp"
    config_class = HiVLPConfig
    loss_fn = staticmethod(hivlp_loss)  # an ablation's subclass sets its own, and checkpoint_prefix

    def __init__(self, config: HiVLPConfig | None = None, name: str = "hivlp-flat",
                 progress: bool = True):
        super().__init__(config, name, progress)

    @property
    def notes(self) -> str:
        c = self.config
        return (f"HiVLP last level (d={c.eol_widths[-1]}) over every candidate; {self.towers}, "
                f"EOL widths {'/'.join(map(str, c.eol_widths))}; FAISS IndexFlatIP")

    @property
    def towers(self) -> str:
        c = self.config
        stem = "frozen" if c.freeze_stem else "fine-tuned"
        image = (f"region tower {c.image_layers} blocks" if c.image_input == "regions" else
                 f"pixel stem grid ({stem}) + {c.image_layers} blocks" if c.stem == "pixel_stem"
                 else f"ViT {c.image_layers} blocks over {c.patch_size}px patches")
        return f"{image}, text {c.text_layers} blocks"

    def build_model(self, bench: dict, tokenizer) -> HiVLP:
        return build_hivlp(self.config, bench["train"], tokenizer)

    def starts_from_stem(self) -> bool:
        return uses_pixel_stem(self.config)

    def train(self, bench: dict, tokenizer, checkpoint_path, cache_dir):
        stem = self.stem_checkpoint(bench, cache_dir)
        return train_hivlp(bench, tokenizer, self.config, checkpoint_path=checkpoint_path,
                           stem_checkpoint=stem, progress=self.progress, loss_fn=self.loss_fn,
                           **self.learning_curve(bench, self.config.max_steps))

    def states(self, split) -> HiVLPStates:
        return self.cached_states(split, compute_states)

    def rank_level(self, split, direction: str, top_k: int, level: int, queries=None):
        """Exact top_k by S^level (0-based) from a FAISS index of the gallery's cached vectors."""
        queries = torch.as_tensor(query_indices(split, direction, queries), dtype=torch.long)
        states = self.states(split)  # t2i: the captions search the images
        sides = (states.image, states.text) if direction == "t2i" else (states.text, states.image)
        gallery, asked = (side[level] for side in sides)
        scores, indices = search(build_index(gallery), asked[queries], min(top_k, len(gallery)))
        return torch.as_tensor(indices, dtype=torch.long), torch.as_tensor(scores)

    def rank(self, split, direction: str, top_k: int, queries=None):
        return self.rank_level(split, direction, top_k, self.config.n_levels - 1, queries)

    def score_level(self, split, image_indices, text_indices, level: int) -> torch.Tensor:
        """S^level (P,) of the pairs (image_indices[p], text_indices[p]) from cached vectors."""
        states = self.states(split)
        images, texts = checked_pairs(image_indices, text_indices)  # (P,) each
        return (states.image[level][images] * states.text[level][texts]).sum(-1)  # (P, d) each

    def online_query_fn(self, split, caption_index: int = 0, top_k: int = 10, levels=None,
                        survivors=SURVIVORS):
        """One caption -> (top_k,) images: the text tower, then coarse_to_fine_one at `levels`."""
        model, images = self._fitted().eval(), self.states(split).image  # [(G, d_l)] float32
        levels = list(range(model.config.n_levels)) if levels is None else list(levels)
        gallery = [np.ascontiguousarray(images[level].numpy()) for level in levels]
        caption = split.captions[caption_index]
        tokenizer, encoder = self.query_side(caption, max_length=model.config.max_text_length,
                                             encode_name="text_levels")

        def answer() -> np.ndarray:
            query = encoder(*tokenizer(caption))  # every level's (1, d_l), float32 numpy
            return coarse_to_fine_one(gallery, [query[level][0] for level in levels], survivors,
                                      top_k)

        return answer

    def level(self, level: int) -> HiVLPLevel:
        return HiVLPLevel(self, level)


class HiVLPLevel(Ranker):
    """One 0-based `level` of a HiVLPMethod as a cascade stage, ranking or scoring pairs by S^l."""

    dot_product = True  # score_pairs is a dot product of cached vectors: no cross pairs to budget

    def __init__(self, parent: HiVLPMethod, level: int):
        if not 0 <= level < parent.config.n_levels:
            raise ValueError(f"level must be in [0, {parent.config.n_levels}), got {level}")
        self.parent, self.level_index, self.progress = parent, level, parent.progress
        self.name, self.config = f"{parent.name.replace('-flat', '')}-eol{level + 1}", parent.config
        self.notes = (f"HiVLP level {level + 1} alone (d={parent.config.eol_widths[level]}) over "
                      "every candidate")

    model = property(lambda self: self.parent.model)
    tokenizer = property(lambda self: self.parent.tokenizer)

    def fit(self, bench, tokenizer, cache_dir=None):
        """Fit the parent, whose model a level is a view of."""
        if self.parent.model is None:
            self.parent.fit(bench, tokenizer, cache_dir)
        return self

    def rank(self, split, direction: str, top_k: int, queries=None):
        return self.parent.rank_level(split, direction, top_k, self.level_index, queries)

    def score_pairs(self, split, image_indices, text_indices) -> torch.Tensor:
        return self.parent.score_level(split, image_indices, text_indices, self.level_index)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """One caption against the whole gallery at this level alone (the online path)."""
        return self.parent.online_query_fn(split, caption_index, top_k, levels=[self.level_index],
                                           survivors=())


class HiVLPCascade(Cascade):
    """HiVLP's coarse-to-fine retrieval (§3.4): a Cascade of its levels, survivors (N2, N3, ...)."""

    def __init__(self, hivlp: HiVLPMethod, survivors=SURVIVORS, name: str | None = None):
        n, widths = hivlp.config.n_levels, hivlp.config.eol_widths  # Cascade checks n - 1 counts
        super().__init__([hivlp.level(level) for level in range(n)], list(survivors),
                         name=name or hivlp.name.replace("-flat", ""),
                         notes=(f"HiVLP cascade ({hivlp.towers}): level 1 (d={widths[0]}) keeps "
                                f"{'/'.join(map(str, survivors))}, the last level "
                                f"(d={widths[-1]}) orders them"))
        self.hivlp = hivlp

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        return self.hivlp.online_query_fn(split, caption_index, top_k, survivors=self.top_ms)


@register_method("hivlp-flat", order=5.0)
def _hivlp_flat(build) -> HiVLPMethod:
    return HiVLPMethod(build.config(HiVLPConfig))


@register_method("hivlp", order=5.1)
def _hivlp(build) -> HiVLPCascade:
    return HiVLPCascade(build.method("hivlp-flat"))


@register_method(f"hivlp+rerank@{RERANK_TOP_M}", order=5.2)
def _hivlp_rerank(build) -> Cascade:
    flat = build.method("hivlp-flat")
    levels = [flat.level(level) for level in range(flat.config.n_levels)]
    return Cascade(levels + [build.method("cross_encoder")], list(SURVIVORS) + [RERANK_TOP_M],
                   name=f"hivlp+rerank@{RERANK_TOP_M}",
                   notes=(f"the HiVLP cascade's top {RERANK_TOP_M} re-scored by the cross-encoder "
                          "(the paper's +CM, with lesson 02's cross-encoder)"))


@register_method("hivlp-regions", order=5.3)
def _hivlp_regions(build) -> HiVLPCascade:
    # the region tower as deep as LightningDOT's (docs/tuning_notes.md, "HiVLP")
    flat = HiVLPMethod(build.config(HiVLPConfig, image_input="regions", image_layers=2),
                       name="hivlp-regions-flat")
    return HiVLPCascade(flat, name="hivlp-regions")
