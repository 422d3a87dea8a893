"""The protocol every benchmark method follows (Ranker): `fit` once (train, or load the cached or
shipped model), then `rank` ("t2i": captions query images, "i2t": images query captions).

Ranking, not a dense (N, T) matrix, is the protocol: the full setting's would take 2.9 GB.
Method: a Ranker with a trained model, cached under a name hashing what it is trained from (its
`stage`), never its source. DualEncoderMethod: + a FAISS index of the gallery. PairwiseMethod: +
score_block, from which pairwise.PairwiseRanking ranks.
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
from course_lib.methods.encoding import encode_captions, encode_gallery, learning_curve_splits
from course_lib.methods.pairwise import PairwiseRanking
from course_lib.methods.queries import TopK, query_indices

QUERY_MAX_LENGTH = 40  # tokens of one text query, [CLS] and [SEP] included (TextCollate's default)
CURVE_POINTS = 8  # evaluations of a learning curve over one training run (Method.learning_curve)


class Ranker(ABC):
    """What the benchmark runs: `fit`, then `rank` and `query_fn`, within its budgets."""

    # (default run, smoke run) budgets. eval_pairs: pairs scored per setting and direction (None:
    # every query; beyond it a fixed random sample of queries). timed_sizes: the galleries a query
    # is timed on (None: up to each setting's; bigger ones are extrapolated linearly and starred).
    eval_pairs: ClassVar[tuple] = (None, None)
    # the most pairs per setting and direction `--every-pair` may score (None: no limit)
    every_pair_limit: ClassVar[int | None] = None
    timed_sizes: ClassVar[tuple] = (None, None)
    notes: str = ""

    @abstractmethod
    def fit(self, bench: dict, tokenizer, cache_dir=None) -> Ranker:
        """Make it ready to rank: train (or load) what it needs on bench["train"]."""

    @abstractmethod
    def rank(self, split, direction: str, top_k: int, queries=None) -> TopK:
        """Each query's top_k gallery items: (indices (Q, k) long, scores (Q, k)), best first."""

    @abstractmethod
    def query_fn(self, split, caption_index: int = 0, top_k: int = 10):
        """A zero-argument callable -> (top_k,) image indices for caption `caption_index`."""

    def pairs_per_query(self, split, direction: str) -> int:
        """Cross-attention pairs one query scores (0: a dot-product search)."""
        return 0


class Method(Ranker):
    """A Ranker with a trained model, named by what it is trained from (`stage`); a subclass sets
    checkpoint_prefix and config_class and implements build_model and train."""

    checkpoint_prefix: ClassVar[str] = "method"
    config_class: ClassVar[type]
    # bump when the parameter layout or training recipe changes on purpose: retrains every model
    format_version: ClassVar[int] = 1

    def __init__(self, config=None, name: str | None = None, progress: bool = True):
        self.config = config if config is not None else self.config_class()
        self.name, self.progress = name or self.checkpoint_prefix, progress
        self.model = self.tokenizer = self.history = self.checkpoint_path = None
        self.from_shipped = False  # fit loaded a shipped model (course_lib.core.shipped)

    def stage(self, bench: dict, tokenizer, *starts_from) -> Stage:
        """What the model is trained from (it names its file): every config field, bench["train"],
        the vocabulary, and starts_from: its earlier stages or starting models (None skipped)."""
        return Stage(self.checkpoint_prefix, reads=config_fields(self.config), data=bench["train"],
                     vocabulary=tokenizer, version=self.format_version, starts_from=starts_from)

    @abstractmethod
    def build_model(self, bench: dict, tokenizer) -> nn.Module:
        """The untrained model a shipped model's weights load into."""

    @abstractmethod
    def train(self, bench: dict, tokenizer, checkpoint_path, cache_dir):
        """Train on bench["train"] (or load a finished checkpoint_path) -> (model, history)."""

    def fit(self, bench: dict, tokenizer, cache_dir=None) -> Method:
        """Load the matching shipped model (not in smoke or COURSE_RETRAIN=1 runs), else train."""
        self.tokenizer, self.checkpoint_path, self.from_shipped = tokenizer, None, False
        stage = self.stage(bench, tokenizer)  # the model's identity, computed once
        path = shipped.find_shipped(shipped.shipped_folder(), self.name, stage)
        if path is not None:  # no training, nor any earlier stage's
            model = self.build_model(bench, tokenizer)
            self.history = shipped.load_shipped(path, model)
            self.model, self.checkpoint_path = model.to(get_device()).eval(), path
            self.from_shipped = True
        else:
            self.checkpoint_path = stage.path(cache_dir)
            self.model, self.history = self.train(bench, tokenizer, self.checkpoint_path, cache_dir)
        return self

    def shipped_file(self, bench: dict, tokenizer):
        """The shipped model `fit` would load (a Path); None: none matches, retraining or smoke."""
        stage = self.stage(bench, tokenizer)
        return shipped.find_shipped(shipped.shipped_folder(), self.name, stage)

    def learning_curve(self, bench: dict, steps: int, n_images: int = 1000) -> dict:
        """Training kwargs that log retrieval on val and train[:n_images] CURVE_POINTS times."""
        return dict(evaluate_on=learning_curve_splits(bench, n_images),
                    eval_every=max(1, steps // CURVE_POINTS))

    def _fitted(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"{self.name}: call fit(bench, tokenizer, cache_dir) first")
        return self.model

    def _kept(self, attr: str, make=SplitCache):
        """The cache held in attribute `attr`, made on first use."""
        if getattr(self, attr, None) is None:
            setattr(self, attr, make())
        return getattr(self, attr)

    def cached_states(self, split, compute_states):
        """compute_states(model, split, tokenizer), once per split and fitted model (SplitCache)."""
        return self._kept("_states").get(
            split, self.model, lambda: compute_states(self._fitted(), split, self.tokenizer))

    def trained_model_of(self, other: Method, bench: dict, tokenizer, cache_dir, *,
                         needed: bool) -> nn.Module:
        """`other`'s model, fitted if needed, else only built (our checkpoint holds a copy)."""
        return (other.fit(bench, tokenizer, cache_dir).model if needed
                else other.build_model(bench, tokenizer))


# ----------------------------------------------------------------------------- training
def fit_pairs(model: nn.Module, loss_fn, split, tokenizer, config, *, modality: str = "regions",
              image_size=None, max_text_length: int = 40, evaluate=None, **runtime) -> History:
    """The course's training recipe: `split`'s (image, caption) pairs through the Trainer with
    config's training fields, `runtime` on top (checkpoint_path, progress, device, ...)."""
    pairs = PairDataset(split, modality=modality, image_size=image_size)
    return Trainer(model, loss_fn, pairs, train_config(config, **runtime),
                   collate_fn=PairCollate(tokenizer, max_text_length), evaluate=evaluate).fit()


class DualEncoderMethod(Method):
    """A Method whose model scores by a dot product of two independent embeddings."""

    def similarity(self, split) -> torch.Tensor:
        return self.gallery_embeddings(split) @ self.caption_embeddings(split).T  # (N, T)

    def gallery_embeddings(self, split) -> torch.Tensor:
        """(N, E) image embeddings, once per split and fitted model (SplitCache)."""
        return self._kept("_gallery").get(split, self.model,
                                          lambda: encode_gallery(self._fitted(), split))

    def caption_embeddings(self, split) -> torch.Tensor:
        """(T, E) caption embeddings, the gallery of image queries (as above)."""
        return self._kept("_captions").get(
            split, self.model, lambda: encode_captions(self._fitted(), split, self.tokenizer))

    def rank(self, split, direction: str, top_k: int, queries=None) -> TopK:
        """Exact top_k by dot product via a FAISS index of the gallery side: no (N, T) matrix."""
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
        scores, indices = search(build_index(gallery), asked, min(top_k, len(gallery)))  # exact
        return torch.as_tensor(indices, dtype=torch.long), torch.as_tensor(scores)  # (Q, k) each

    def query_side(self, probe_caption: str, *, max_length: int = QUERY_MAX_LENGTH,
                   backend: str = "auto",
                   encode_name: str = "encode_texts") -> tuple[QueryTokenizer, QueryEncoder]:
        """(QueryTokenizer, QueryEncoder) of the model's `encode_name`, built once (QuerySide)."""
        return self._kept("_query_side", QuerySide).get(
            self._fitted().eval(), self.tokenizer, probe_caption, max_length=max_length,
            backend=backend, encode_name=encode_name)

    def query_fn(self, split, caption_index: int = 0, top_k: int = 10, index_kind: str = "flat",
                 with_scores: bool = False, backend: str = "auto"):
        """One text query's online cost: the gallery is indexed here (offline), each call tokenises,
        encodes and searches on core.serving's lean path -> (top_k,) image indices (with_scores: and
        scores). backend="reference": the eager path it replaced."""
        model = self._fitted().eval()
        index = build_index(self.gallery_embeddings(split), kind=index_kind)  # offline: (N, E)
        caption = split.captions[caption_index]
        if backend == "reference":  # the eager path (notebook 03's "before", the tests' reference)
            collate, device = TextCollate(self.tokenizer, QUERY_MAX_LENGTH), model_device(model)

            @torch.no_grad()
            def answer() -> np.ndarray:
                batch = {k: v.to(device) for k, v in collate.encode([caption]).items()}  # (1, T)
                query = model.encode_texts(batch).float().cpu()  # (1, E)
                scores, indices = search(index, query, top_k)  # (1, top_k) each
                return (indices[0], scores[0]) if with_scores else indices[0]

            return answer
        path = TextQueryPath(*self.query_side(caption, backend=backend), Searcher(index, top_k))

        def answer():
            scores, indices = path(caption)  # (top_k,) each
            return (indices, scores) if with_scores else indices

        return answer

    def image_query_fn(self, split, image_index: int = 0, top_k: int = 10,
                       index_kind: str = "flat"):
        """The same for image queries (eager, inference_mode) -> (top_k,) caption indices."""
        model, device = self._fitted().eval(), model_device(self.model)
        searcher = Searcher(build_index(self.caption_embeddings(split), kind=index_kind), top_k)
        image = ImageDataset(split, modality=model.modality)[image_index]
        image = {k: v[None] for k, v in image.items() if torch.is_tensor(v)}  # (1, ...)

        @torch.inference_mode()
        def answer() -> np.ndarray:
            batch = {k: v.to(device) for k, v in image.items()}
            return searcher(model.encode_images(batch).float().cpu().numpy())[1]  # (top_k,)

        return answer


class PairwiseMethod(PairwiseRanking, Method):
    """A Method scoring (image, caption) pairs jointly: implements score_block (n, m)."""
