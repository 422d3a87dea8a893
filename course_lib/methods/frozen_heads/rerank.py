"""Two stages on frozen features (LightningDOT's re-ranking): a dual encoder's top M, re-scored by a
pairwise scorer (the cross-encoder or SCAN's attention), fused with the dual's logit by a beta chosen on val."""

from __future__ import annotations

import numpy as np
import torch

from course_lib.methods.frozen_heads.training import FrozenMethod
from course_lib.methods.queries import query_indices, top_k_of

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


class RerankMethod(FrozenMethod):
    """Two stages (LightningDOT's re-ranking): the dual encoder's top M, re-scored by the cross-encoder;
    score = cross logit + beta x the dual's logit (beta = 0: LightningDOT's, the cross score alone)."""

    def __init__(self, name: str, dual, cross, survivors: int, beta: float = 0.0):
        """dual: a fitted DualHeadsMethod; cross: a fitted pairwise scorer (CrossHeadsMethod, SCANHeadsMethod)."""
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


__all__ = ["rerank_query", "RerankMethod"]
