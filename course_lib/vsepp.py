"""VSE++ (Faghri et al., BMVC 2018): a dual encoder of cosine similarities, trained with a hinge loss.

An image encoder and a text encoder (course_lib.encoders) each end in a linear projection to one
shared space, and both vectors are L2-normalised, so a score is a cosine similarity:

    s(image, text) = <normalize(W_i f(image)), normalize(W_t g(text))>

Training scores the B images of a batch against its B captions (`DualEncoder.forward`, positives
on the diagonal) and minimises `hinge_triplet_loss`: with max_violation only the hardest negative
of each query counts (VSE++'s "MH" loss), else every hinge is summed (the older "sum of hinges").
Because images and texts never meet before the dot product, the gallery is embedded once, offline,
into a FAISS index (course_lib.retrieval), and a text query costs one text encoding plus a top-k.

    model, history = train_dual_encoder(bench, tokenizer, VsePPConfig())
    image_emb, text_emb = encode_split(model, bench["test"], tokenizer)   # (N, E), (T, E)
    sims = image_emb @ text_emb.T                                          # = similarity(...)

`VsePPMethod` wraps this for `python -m course_lib.benchmark`. The training schedule is the
course's Trainer (AdamW, warm-up then linear decay), not VSE++'s step decay; the loss, margin,
batch size, learning rate and gradient clipping are VSE++'s.

Max violation vs sum of hinges. VSE++ trains a linear map over fixed, pretrained CNN features,
where MH beats the sum. Here both encoders start from random weights: every image starts near one
direction (cosine ~0.86 between images), so each query's hardest negative outscores its positive,
and MH alone drives all embeddings onto one vector (every score equal, loss 2 * B * margin), the
collapse FaceNet (Schroff et al. 2015) reports for hardest-negative mining early in training. A
sum-of-hinges warm-up (VSE-infinity's recipe, `sum_warmup_steps`) does not prevent it in our
budget, nor does masking the generator's true false negatives out of the batch, so the default is
the sum of hinges; notebook 01 shows both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from course_lib.data.datasets import (CaptionDataset, ImageDataset, PairCollate, PairDataset,
                                      TextCollate, make_loader)
from course_lib.checkpoints import checkpoint_name, model_device
from course_lib.encoders import build_image_encoder, build_text_encoder, l2_normalize
from course_lib.losses import hinge_triplet_loss
from course_lib.metrics import retrieval_metrics
from course_lib.retrieval import build_index, search
from course_lib.settings import CourseConfig, seed_everything
from course_lib.train import History, TrainConfig, Trainer

_TEXT_NAMES = {"gru": "bi-GRU", "bow": "bag-of-words", "bert": "BERT (random init)"}
_IMAGE_NAMES = {"regions": "region transformer", "pixels": "tiny ViT on pixels"}
# splits with more items than this get a progress bar while they are encoded
_PROGRESS_ITEMS = 20_000


@dataclass
class VsePPConfig(CourseConfig):
    image_encoder: str = "regions"  # "regions" (detector features, as VSE++/SCAN) or "pixels" (tiny ViT)
    text_encoder: str = "gru"  # "gru" (VSE++'s), "bow" (mean of word vectors) or "bert" (random init)
    hidden: int = 64  # width inside both encoders
    embed_dim: int = 64  # size of the joint space both projections map to
    layers: int = 2  # depth of both encoders: transformer blocks, or stacked GRU layers
    margin: float = 0.2  # hinge margin (VSE++)
    # True = hardest negative only (VSE++'s "MH"); False = sum of all hinges. False by default: with
    # encoders trained from scratch, MH collapses every embedding to one vector on this benchmark
    # (loss pinned at 2 * batch * margin), even after a sum warm-up (module docstring)
    max_violation: bool = False
    batch_size: int = 128  # (image, caption) pairs per batch; the in-batch negatives (VSE++)
    lr: float = 2e-4  # peak AdamW learning rate (VSE++'s Adam rate)
    max_steps: int = 1500  # ~4 epochs of the 10k-scene train split (50k pairs): 2-3 min on a CPU core
    warmup_fraction: float = 0.05  # share of steps warming up; then linear decay to 0
    grad_clip: float = 2.0  # max gradient norm (VSE++)
    sum_warmup_steps: int = 0  # with max_violation: sum all hinges for these first steps (VSE-inf)
    seed: int = 0  # model initialisation and data order

    SMOKE: ClassVar[dict] = {"max_steps": 40}  # smoke(): tiny training, same code path


class DualEncoder(nn.Module):
    """Image encoder + text encoder, each projected to embed_dim and L2-normalised (VSE++).

    encode_images(batch) / encode_texts(batch) -> (B, E) unit vectors; forward(pair_batch) ->
    scores (B, B), rows images, columns texts, positives on the diagonal.
    `modality` ("regions" / "pixels") is the image field the datasets must provide.
    """

    def __init__(self, config: VsePPConfig, vocab_size: int, region_dim: int | None = None,
                 image_size: int | None = None):
        super().__init__()
        self.config, self.modality = config, config.image_encoder
        c = config
        if c.image_encoder == "regions":
            if region_dim is None:
                raise ValueError("image_encoder='regions' needs region_dim (split.regions.shape[-1])")
            image = dict(region_dim=region_dim, hidden=c.hidden, layers=c.layers)
        elif c.image_encoder == "pixels":  # the course's tiny ViT, sized like the region encoder
            image = dict(embed_dim=c.hidden, depth=c.layers, **({"img_size": image_size} if image_size else {}))
        else:
            image = {}  # build_image_encoder lists the valid kinds
        self.image_encoder = build_image_encoder(c.image_encoder, **image)
        text = {"gru": dict(embed_dim=c.hidden, hidden=c.hidden, layers=c.layers),
                "bert": dict(hidden=c.hidden, layers=c.layers)}.get(c.text_encoder, dict(hidden=c.hidden))
        self.text_encoder = build_text_encoder(c.text_encoder, vocab_size, **text)
        self.image_proj = nn.Linear(self.image_encoder.out_dim, c.embed_dim)
        self.text_proj = nn.Linear(self.text_encoder.out_dim, c.embed_dim)

    def encode_images(self, batch: dict) -> torch.Tensor:
        pooled = self.image_encoder(batch).pooled  # (B, H)
        return l2_normalize(self.image_proj(pooled))  # (B, E), unit norm: scores are cosines

    def encode_texts(self, batch: dict) -> torch.Tensor:
        pooled = self.text_encoder(batch).pooled  # (B, H)
        return l2_normalize(self.text_proj(pooled))  # (B, E)

    def forward(self, batch: dict) -> torch.Tensor:
        # A PairCollate batch holds one image per caption, so two captions of the same image can
        # land in one batch and then count as each other's negatives. VSE++ ignores this, and so
        # do we: with 10k training images (50k captions) a batch of 128 rarely holds such a pair.
        return self.encode_images(batch) @ self.encode_texts(batch).T  # (B, B)


def vsepp_loss(margin: float = 0.2, max_violation: bool = True, sum_warmup_steps: int = 0,
               get_step=None):
    """A `loss_fn(model, batch)` for course_lib.train.Trainer: VSE++'s hinge on model(batch).

    sum_warmup_steps > 0 (with max_violation) sums every hinge for the first steps, then keeps only
    the hardest negatives, as VSE-infinity's `vse_mean_warmup_epochs`: from random weights all
    embeddings start close together, and the max-violation loss alone can collapse them (module
    docstring). get_step() must return the optimizer steps taken so far (Trainer.step), so a
    resumed run switches at the same step.
    """
    if sum_warmup_steps and max_violation and get_step is None:
        raise ValueError("sum_warmup_steps needs get_step, e.g. get_step=lambda: trainer.step")

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        hardest = max_violation and not (sum_warmup_steps and get_step() < sum_warmup_steps)
        return hinge_triplet_loss(model(batch), margin=margin, max_violation=hardest)

    return loss_fn


def build_dual_encoder(config: VsePPConfig, train_split, tokenizer) -> DualEncoder:
    """A fresh DualEncoder sized for the split's features and the tokenizer's vocabulary."""
    region_dim = train_split.regions.shape[-1] if train_split.has_regions else None
    image_size = train_split.images.shape[1] if train_split.images is not None else None
    return DualEncoder(config, len(tokenizer), region_dim=region_dim, image_size=image_size)


def train_dual_encoder(bench: dict, tokenizer, config: VsePPConfig | None = None, *,
                       checkpoint_path=None, evaluate_on=None, eval_every: int | None = None,
                       progress: bool = True, device: str | None = None) -> tuple[DualEncoder, History]:
    """Train a DualEncoder on bench["train"] with the VSE++ loss; returns (model, history).

    checkpoint_path: where the Trainer saves; a finished checkpoint there is loaded instead of
        training (delete it to retrain). evaluate_on: a split (e.g. bench["val"]) whose
        retrieval_metrics (R@1/5/10 both ways, ar) are logged every eval_every steps and at the end.
    """
    config = config or VsePPConfig()
    seed_everything(config.seed)  # the model's initial weights; the Trainer seeds the rest
    model = build_dual_encoder(config, bench["train"], tokenizer)
    train = TrainConfig(max_steps=config.max_steps, batch_size=config.batch_size, lr=config.lr,
                        warmup_fraction=config.warmup_fraction, grad_clip=config.grad_clip,
                        seed=config.seed, eval_every=eval_every, log_every=25, progress=progress,
                        checkpoint_path=None if checkpoint_path is None else str(checkpoint_path),
                        device=device)
    evaluate = None
    if evaluate_on is not None:
        def evaluate(m):
            return retrieval_metrics(similarity(m, evaluate_on, tokenizer), evaluate_on.txt2img)
    trainer = None  # the loss reads trainer.step once the Trainer exists (below)
    loss_fn = vsepp_loss(config.margin, config.max_violation, config.sum_warmup_steps,
                         get_step=lambda: trainer.step)
    trainer = Trainer(model, loss_fn,
                      PairDataset(bench["train"], modality=model.modality), train,
                      collate_fn=PairCollate(tokenizer), evaluate=evaluate)
    history = trainer.fit()
    model.eval()
    return model, history


def _encode(model: DualEncoder, loader, encode_name: str, device, progress: bool) -> torch.Tensor:
    """Concatenate model.<encode_name>(batch) over a loader: eval mode, no grad, on `device` (None =
    the model's); the result (n, E) on the CPU. The model's train/eval mode is restored after."""
    device = model_device(model, device)
    was_training = model.training
    model.to(device).eval()
    encode, out = getattr(model, encode_name), []
    try:
        with torch.no_grad():
            for batch in tqdm(loader, desc=encode_name.replace("_", " "), disable=not progress,
                              leave=False):
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                out.append(encode(batch).float().cpu())  # (b, E)
    finally:
        model.train(was_training)
    return torch.cat(out)  # (n, E)


def encode_gallery(model: DualEncoder, split, *, batch_size: int = 256, device=None,
                   progress: bool | None = None) -> torch.Tensor:
    """(N, E) image embeddings of a split, on the CPU. progress None = a bar for big splits."""
    loader = make_loader(ImageDataset(split, modality=model.modality), batch_size)
    progress = split.n_images > _PROGRESS_ITEMS if progress is None else progress
    return _encode(model, loader, "encode_images", device, progress)


def encode_captions(model: DualEncoder, split, tokenizer, *, batch_size: int = 256, device=None,
                    progress: bool | None = None) -> torch.Tensor:
    """(T, E) caption embeddings of a split, on the CPU. progress None = a bar for big splits."""
    loader = make_loader(CaptionDataset(split), batch_size, tokenizer=tokenizer)
    progress = split.n_texts > _PROGRESS_ITEMS if progress is None else progress
    return _encode(model, loader, "encode_texts", device, progress)


def encode_split(model: DualEncoder, split, tokenizer, *, batch_size: int = 256, device=None,
                 progress: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(image_emb (N, E), text_emb (T, E)) of a split, on the CPU. progress None = bar for big splits."""
    kwargs = dict(batch_size=batch_size, device=device, progress=progress)
    return encode_gallery(model, split, **kwargs), encode_captions(model, split, tokenizer, **kwargs)


def similarity(model: DualEncoder, split, tokenizer, **kwargs) -> torch.Tensor:
    """(N, T) cosine similarities of every image and caption of a split (kwargs: encode_split's)."""
    image_emb, text_emb = encode_split(model, split, tokenizer, **kwargs)
    return image_emb @ text_emb.T  # (N, T)


class VsePPMethod:
    """VSE++ as a benchmark Method (see course_lib.benchmark): fit, similarity, query_fn."""

    def __init__(self, config: VsePPConfig | None = None, name: str = "vsepp", progress: bool = True):
        self.config, self.name, self.progress = config or VsePPConfig(), name, progress
        self.model = self.tokenizer = self.history = self.checkpoint_path = None

    @property
    def notes(self) -> str:
        c = self.config
        loss = "max-violation hinge" if c.max_violation else "sum of hinges"
        return (f"dual encoder, {_TEXT_NAMES.get(c.text_encoder, c.text_encoder)} text / "
                f"{_IMAGE_NAMES.get(c.image_encoder, c.image_encoder)}, cosine, {loss}, "
                "FAISS IndexFlatIP")

    def fit(self, bench: dict, tokenizer, cache_dir=None) -> "VsePPMethod":
        """Train on bench["train"], or load cache_dir / checkpoint_name(...) if it is there."""
        self.tokenizer, self.checkpoint_path = tokenizer, None
        if cache_dir is not None:
            name = checkpoint_name("vsepp", self.config.to_dict(), bench["train"], tokenizer)
            self.checkpoint_path = Path(cache_dir) / name
        self.model, self.history = train_dual_encoder(bench, tokenizer, self.config,
                                                      checkpoint_path=self.checkpoint_path,
                                                      progress=self.progress)
        return self

    def _fitted(self) -> DualEncoder:
        if self.model is None:
            raise RuntimeError(f"{self.name}: call fit(bench, tokenizer, cache_dir) first")
        return self.model

    def similarity(self, split) -> torch.Tensor:
        return similarity(self._fitted(), split, self.tokenizer)  # (N, T)

    def query_fn(self, split, top_k: int = 10, caption_index: int = 0):
        """A zero-argument callable answering one text query: the online cost of retrieval.

        The gallery's image embeddings are computed once, here (offline), into an exact FAISS
        index; each call tokenises one caption, runs the text encoder and projection, and searches
        the index. Returns the top_k image indices (top_k,), best first.
        """
        model = self._fitted().eval()
        index = build_index(encode_gallery(model, split))  # offline: (N, E) vectors in IndexFlatIP
        collate, device = TextCollate(self.tokenizer), model_device(model)
        caption = split.captions[caption_index]

        @torch.no_grad()
        def answer() -> np.ndarray:
            batch = {k: v.to(device) for k, v in collate.encode([caption]).items()}  # (1, T)
            query = model.encode_texts(batch).float().cpu()  # (1, E)
            return search(index, query, top_k)[1][0]  # (top_k,)

        return answer


__all__ = ["VsePPConfig", "DualEncoder", "vsepp_loss", "build_dual_encoder", "train_dual_encoder",
           "encode_gallery", "encode_captions", "encode_split", "similarity",
           "VsePPMethod"]
