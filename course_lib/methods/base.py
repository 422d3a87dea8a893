"""The Method protocol every benchmark method follows: train once (or load the cached
checkpoint), then rank.

    fit(bench, tokenizer, cache_dir): train on bench["train"], or load the cached checkpoint
    rank(split, direction, top_k, queries=None) -> (indices (Q, k), scores (Q, k)), best first:
        each query's top_k gallery items. "t2i": captions query images; "i2t": images query
        captions. queries default to the split's (split.text_queries / image_queries: the test
        items in the full setting)
    query_fn(split, caption_index, top_k): a zero-argument callable answering one text query,
        (top_k,) image indices: the online cost, timed
    pairs_per_query(split, direction): cross-attention pairs scored per query (0 for a dot
        product): what the benchmark's pair budget counts
    eval_pairs, timed_sizes: (default, smoke) budgets the benchmark honours; notes: one line for
        the results table

Ranking, not a dense (n_images, n_texts) matrix, is the protocol (the full setting's would take
2.9 GB); recalls need only each query's top K (`metrics.ranks_from_top_k`).

    Ranker              what the benchmark runs (fit, rank, query_fn, budgets); a cascade
                        (methods.rerank) is a Ranker over fitted Methods
    Method              + a trained model of its own, cached under a name that hashes what it
                        is trained from (Method.stage, a core.stages.Stage: the config fields
                        it reads, data, vocabulary, the models it starts from, its version),
                        never its source code; fit loads the shipped model instead when one
                        matches (core.shipped)
    DualEncoderMethod   + what every dot-product model shares (VSE++, LightningDOT): the gallery
                        is embedded once into a FAISS index, a query costs one encoding and a
                        top-k, on the lean path of core.serving
    PairwiseMethod      + what every cross-attention scorer shares (SCAN, the cross-encoder): it
                        implements score_block(split, images, texts) and inherits rank,
                        similarity and score_pairs (the re-ranker API of rerank.Cascade) from
                        pairwise.PairwiseRanking

`fit_pairs` is the one training recipe (a split's (image, caption) pairs through the Trainer);
`Method.cached_states` keeps a gallery's offline states (U-BERT's, HiVLP's, Slow's) per split
and model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from course_lib.core import shipped
from course_lib.core.checkpoints import model_device
from course_lib.core.history import History
from course_lib.core.retrieval import build_index, search
from course_lib.core.serving import QueryEncoder, QuerySide, QueryTokenizer, Searcher, TextQueryPath
from course_lib.core.settings import get_device
from course_lib.core.split_cache import SplitCache
from course_lib.core.stages import Stage, config_fields
from course_lib.core.train import Trainer
from course_lib.core.train_config import train_config
from course_lib.data.datasets import ImageDataset, PairCollate, PairDataset, TextCollate
from course_lib.methods.encoding import (
    encode_captions,
    encode_gallery,
    learning_curve_splits,
    similarity,
)
from course_lib.methods.pairwise import PairwiseRanking
from course_lib.methods.queries import query_indices

# tokens of one text query, [CLS] and [SEP] included (TextCollate's default)
QUERY_MAX_LENGTH = 40
# evaluations of a dual encoder's learning curve over one training run (Method.learning_curve)
CURVE_POINTS = 8


class Ranker(ABC):
    """What the benchmark runs: `fit`, then `rank` and `query_fn`, within its budgets."""

    # benchmark budgets, (default run, smoke run). eval_pairs: pairs it may score per setting and
    # direction (None = every query); beyond it, a fixed random sample of queries is ranked.
    # timed_sizes: the galleries one query is timed on (None = up to each setting's gallery);
    # bigger galleries are extrapolated linearly from these and starred.
    eval_pairs: ClassVar[tuple] = (None, None)
    # the most pairs per setting and direction `--every-pair` may make it score (None = no limit);
    # beyond it the method stays on its eval_pairs sample (a model that costs ~an hour a setting)
    every_pair_limit: ClassVar[int | None] = None
    timed_sizes: ClassVar[tuple] = (None, None)
    notes: str = ""

    @abstractmethod
    def fit(self, bench: dict, tokenizer, cache_dir=None) -> Ranker:
        """Make it ready to rank: train (or load) what it needs on bench["train"]."""

    @abstractmethod
    def rank(self, split, direction: str, top_k: int,
             queries=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's top_k gallery items: (indices (Q, k) long, scores (Q, k)), best first."""

    @abstractmethod
    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """A zero-argument callable answering caption `caption_index` against the split's images:
        returns (top_k,) image indices, best first. Offline work happens when it is built."""

    def pairs_per_query(self, split, direction: str) -> int:
        """Cross-attention pairs one query scores (0: a dot-product search)."""
        return 0


class Method(Ranker):
    """A Ranker with a trained model of its own, known by what it is trained from (`stage`).
    A subclass sets `checkpoint_prefix` (also its default name) and `config_class` (its default
    config), and implements `build_model(bench, tokenizer)`, the untrained model a shipped model's
    weights load into, and `train(bench, tokenizer, checkpoint_path, cache_dir) -> (model,
    history)`, which loads a finished checkpoint at checkpoint_path instead (core.train.Trainer
    does)."""

    checkpoint_prefix: ClassVar[str] = "method"
    config_class: ClassVar[type]
    # bump when the parameter layout or the training recipe changes on purpose: every cached and
    # shipped model of the method is then trained again
    format_version: ClassVar[int] = 1

    def __init__(self, config=None, name: str | None = None, progress: bool = True):
        self.config = config if config is not None else self.config_class()
        self.name, self.progress = name or self.checkpoint_prefix, progress
        self.model = self.tokenizer = self.history = self.checkpoint_path = None
        self.from_shipped = False  # fit loaded a shipped model (course_lib.core.shipped)

    def stage(self, bench: dict, tokenizer) -> Stage:
        """What the trained model is trained from, which names its file (core.stages.Stage): here
        every config field, bench["train"] and the vocabulary. A method with an earlier stage or a
        model it starts from writes its own."""
        return Stage(self.checkpoint_prefix, reads=config_fields(self.config), data=bench["train"],
                     vocabulary=tokenizer, version=self.format_version)

    @abstractmethod
    def build_model(self, bench: dict, tokenizer) -> nn.Module:
        """The untrained model a shipped model's weights load into."""

    @abstractmethod
    def train(self, bench: dict, tokenizer, checkpoint_path, cache_dir):
        """Train on bench["train"] (or load a finished checkpoint_path); return (model, history)."""

    def fit(self, bench: dict, tokenizer, cache_dir=None) -> Method:
        """Load the shipped model when one matches (shipped.shipped_folder: not in smoke mode, nor
        with COURSE_RETRAIN=1); else train on bench["train"], or load cache_dir /
        stage.file_name if there (a process training that file there is waited for)."""
        self.tokenizer, self.checkpoint_path, self.from_shipped = tokenizer, None, False
        stage = self.stage(bench, tokenizer)  # the model's identity, computed once
        path = shipped.find_shipped(shipped.shipped_folder(), self.name, stage)
        if path is not None:  # no training, nor any earlier stage's
            model = self.build_model(bench, tokenizer)
            self.history = shipped.load_shipped(path, model)
            self.model, self.checkpoint_path = model.to(get_device()).eval(), path
            self.from_shipped = True
            return self
        self.checkpoint_path = stage.path(cache_dir)
        self.model, self.history = self.train(bench, tokenizer, self.checkpoint_path, cache_dir)
        return self

    def shipped_file(self, bench: dict, tokenizer):
        """The shipped model `fit` would load (a Path); None: none matches, retraining or smoke."""
        stage = self.stage(bench, tokenizer)
        return shipped.find_shipped(shipped.shipped_folder(), self.name, stage)

    def learning_curve(self, bench: dict, steps: int, n_images: int = 1000) -> dict:
        """Training kwargs that record the model's learning curve in its history: retrieval on val
        and on train[:n_images] (learning_curve_splits), CURVE_POINTS times over `steps`. Every dual
        encoder passes them, the cross-encoder with smaller galleries (it scores every pair), so the
        trained (and shipped) model carries the curve its notebook shows."""
        return dict(evaluate_on=learning_curve_splits(bench, n_images),
                    eval_every=max(1, steps // CURVE_POINTS))

    def _fitted(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"{self.name}: call fit(bench, tokenizer, cache_dir) first")
        return self.model

    def cached_states(self, split, compute_states):
        """compute_states(model, split, tokenizer): a gallery's offline states, computed once per
        split and fitted model (for the CACHED_SPLITS splits used last, SplitCache)."""
        if getattr(self, "_states", None) is None:
            self._states = SplitCache()
        return self._states.get(split, self.model,
                                lambda: compute_states(self._fitted(), split, self.tokenizer))

    def trained_model_of(self, other: Method, bench: dict, tokenizer, cache_dir, *,
                         needed: bool) -> nn.Module:
        """The model of `other`, a model this one starts from or reads: fitted (trained, or loaded
        from the cache or the shipped folder) when needed, else only built, because a finished
        checkpoint of this model holds its copy of it."""
        return (other.fit(bench, tokenizer, cache_dir).model if needed
                else other.build_model(bench, tokenizer))


# ----------------------------------------------------------------------------- training

def fit_pairs(model: nn.Module, loss_fn, split, tokenizer, config, *, modality: str = "regions",
              image_size=None, max_text_length: int = 40, evaluate=None, **runtime) -> History:
    """The course's training recipe: the (image, caption) pairs of `split` (its image `modality`,
    captions tokenised by PairCollate) through the one Trainer with loss_fn(model, batch, step),
    config's training fields (core.train.train_config) with `runtime` on top (checkpoint_path,
    progress, device, log_every, ...). evaluate(model) -> metrics is logged. Returns the History."""
    pairs = PairDataset(split, modality=modality, image_size=image_size)
    trainer = Trainer(model, loss_fn, pairs, train_config(config, **runtime),
                      collate_fn=PairCollate(tokenizer, max_text_length), evaluate=evaluate)
    return trainer.fit()


class DualEncoderMethod(Method):
    """A Method whose model scores by a dot product of two independent embeddings."""

    def similarity(self, split) -> torch.Tensor:
        return similarity(self._fitted(), split, self.tokenizer)  # (N, T)

    def gallery_embeddings(self, split) -> torch.Tensor:
        """(N, E) embeddings of the split's images, computed once per split and fitted model (the
        offline half of retrieval: rank and every query_fn on the split share them; SplitCache)."""
        if getattr(self, "_gallery", None) is None:
            self._gallery = SplitCache()
        return self._gallery.get(split, self.model, lambda: encode_gallery(self._fitted(), split))

    def caption_embeddings(self, split) -> torch.Tensor:
        """(T, E) embeddings of the split's captions, the gallery of image queries (as above)."""
        if getattr(self, "_captions", None) is None:
            self._captions = SplitCache()
        return self._captions.get(split, self.model,
                                  lambda: encode_captions(self._fitted(), split, self.tokenizer))

    def rank(self, split, direction: str, top_k: int,
             queries=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top_k by dot product through a FAISS index of the gallery side (images for t2i,
        captions for i2t), so no (N, T) matrix is formed. -> (indices (Q, k), scores (Q, k))"""
        queries = query_indices(split, direction, queries)
        model = self._fitted()
        if len(queries) == 0:
            return torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k)
        if direction == "t2i":  # only the query side's asked items are encoded
            gallery = self.gallery_embeddings(split)
            asked = encode_captions(model, split, self.tokenizer, indices=queries)
        else:
            gallery = self.caption_embeddings(split)
            asked = encode_gallery(model, split, indices=queries)
        index = build_index(gallery)  # (G, E) exact inner product
        scores, indices = search(index, asked, min(top_k, len(gallery)))  # (Q, k) each
        return torch.as_tensor(indices, dtype=torch.long), torch.as_tensor(scores)  # (Q, k) each

    def query_side(self, probe_caption: str, *, max_length: int = QUERY_MAX_LENGTH,
                   backend: str = "auto",
                   encode_name: str = "encode_texts") -> tuple[QueryTokenizer, QueryEncoder]:
        """(QueryTokenizer, QueryEncoder) of the fitted model's `encode_name`, built once per model,
        weights, device and arguments (course_lib.core.serving.QuerySide), never per query."""
        if getattr(self, "_query_side", None) is None:
            self._query_side = QuerySide()
        return self._query_side.get(self._fitted().eval(), self.tokenizer, probe_caption,
                                    max_length=max_length, backend=backend,
                                    encode_name=encode_name)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10, index_kind: str = "flat",
                 with_scores: bool = False, backend: str = "auto"):
        """A zero-argument callable answering one text query: the online cost of retrieval.

        The gallery is embedded once, here (offline), into a FAISS index (`index_kind`, exact by
        default); each call tokenises one caption, encodes it and searches, on the lean path of
        course_lib.core.serving (`backend`: its QueryEncoder's; "reference": the eager path it
        replaced). Returns the top_k image indices (top_k,), best first; with_scores: (indices,
        scores), which a Cascade that fuses stage scores reads."""
        model = self._fitted().eval()
        index = build_index(self.gallery_embeddings(split), kind=index_kind)  # offline: (N, E)
        caption = split.captions[caption_index]
        if backend == "reference":
            return self._reference_query_fn(model, index, caption, top_k, with_scores)
        path = TextQueryPath(*self.query_side(caption, backend=backend), Searcher(index, top_k))

        def answer():
            scores, indices = path(caption)  # (top_k,) each
            return (indices, scores) if with_scores else indices

        return answer

    def _reference_query_fn(self, model, index, caption: str, top_k: int, with_scores: bool):
        """The eager path the lean one replaced (the Hugging Face tokenizer's front end, a dict of
        tensors, no_grad, retrieval.search's checks): notebook 03's "before", tests' reference."""
        collate, device = TextCollate(self.tokenizer, QUERY_MAX_LENGTH), model_device(model)

        @torch.no_grad()
        def answer() -> np.ndarray:
            batch = {k: v.to(device) for k, v in collate.encode([caption]).items()}  # (1, T)
            query = model.encode_texts(batch).float().cpu()  # (1, E)
            scores, indices = search(index, query, top_k)  # (1, top_k) each
            return (indices[0], scores[0]) if with_scores else indices[0]

        return answer

    def image_query_fn(self, split, image_index: int = 0, top_k: int = 10,
                       index_kind: str = "flat"):
        """The same for text retrieval: the split's captions are indexed offline, each call encodes
        one image (eager, inference_mode) and searches them -> (top_k,) caption indices."""
        model = self._fitted().eval()
        searcher = Searcher(build_index(self.caption_embeddings(split), kind=index_kind), top_k)
        image = ImageDataset(split, modality=model.modality)[image_index]
        device = model_device(model)

        @torch.inference_mode()
        def answer() -> np.ndarray:
            batch = {k: v[None].to(device)
                     for k, v in image.items() if torch.is_tensor(v)}  # (1, ...)
            return searcher(model.encode_images(batch).float().cpu().numpy())[1]  # (top_k,)

        return answer


class PairwiseMethod(PairwiseRanking, Method):
    """A Method that scores (image, caption) pairs jointly (SCAN, the cross-encoder, Slow): it
    implements score_block (n, m) and inherits the rest (pairwise.PairwiseRanking)."""


__all__ = ["QUERY_MAX_LENGTH", "CURVE_POINTS", "Ranker", "Method", "fit_pairs",
           "DualEncoderMethod", "PairwiseMethod"]
