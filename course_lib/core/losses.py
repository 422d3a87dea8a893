"""Training losses on a score matrix: VSE++ hinge, LightningDOT/CLIP contrastive, Fast & Slow
distillation.

Every loss takes scores `S[i, j]` of image i (rows) and text j (columns), so it serves a dual
encoder (`S = img_emb @ txt_emb.T`), SCAN or any cross-encoder alike; the hinge and contrastive
losses take a square in-batch S with the positive pairs on the diagonal. The functions are the
reference; the `nn.Module` wrappers only hold hyper-parameters (open_clip style)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens


def _check_square(scores: torch.Tensor, name: str) -> None:
    if scores.dim() != 2 or scores.shape[0] != scores.shape[1]:
        raise ValueError(
            f"{name} needs a square (B, B) score matrix with the positive pairs on the diagonal, "
            f"got shape {tuple(scores.shape)}; score the B images of a batch against their own "
            "B texts (one caption per image)")


def batch_scores(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
    """A dual encoder's in-batch scores: (B, E) @ (B, E).T -> (B, B), rows images, columns texts.
    Models return features and the losses form the scores here (open_clip's ClipLoss shape), so a
    multi-process run can gather every process's features first (distributed.gathered_loss): each
    query then meets every negative of the global batch."""
    if image_features.shape != text_features.shape or image_features.dim() != 2:
        raise ValueError(f"image and text features must both be (B, E), got "
                         f"{tuple(image_features.shape)} and {tuple(text_features.shape)}")
    return image_features @ text_features.T  # (B, B)


def hinge_triplet_loss(scores: torch.Tensor, margin: float = 0.2,
                       max_violation: bool = True) -> torch.Tensor:
    """VSE++'s bidirectional hinge (triplet) loss, summed over the batch.
    scores: (B, B), rows images, columns texts, positives on the diagonal. For image i and a wrong
    text j: [margin + S[i, j] - S[i, i]]_+ ; for text j and a wrong image i: [margin + S[i, j] -
    S[j, j]]_+. max_violation=True keeps only each query's hardest negative (VSE++'s "MH" loss);
    False sums every hinge (the older "sum of hinges")."""
    _check_square(scores, "hinge_triplet_loss")
    positives = scores.diagonal().view(-1, 1)  # (B, 1)
    cost_text = (margin + scores - positives).clamp(min=0)  # (B, B): wrong texts per image row
    cost_image = (margin + scores - positives.t()).clamp(min=0)  # (B, B): wrong images per column
    # The positive pair is not its own negative (its hinge would be exactly `margin`).
    is_positive = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    cost_text = cost_text.masked_fill(is_positive, 0)
    cost_image = cost_image.masked_fill(is_positive, 0)
    if max_violation:
        return cost_text.max(dim=1).values.sum() + cost_image.max(dim=0).values.sum()
    return cost_text.sum() + cost_image.sum()


def hinge_name(max_violation: bool) -> str:
    """How method notes name hinge_triplet_loss's two variants."""
    return "max-violation hinge" if max_violation else "sum of hinges"


def contrastive_loss(scores: torch.Tensor) -> torch.Tensor:
    """LightningDOT's CMR / CLIP's loss: (CE over texts per image + CE over images per text) / 2.
    scores: (B, B) logits, positives on the diagonal; each CE is a mean over the batch. No
    temperature here: scale the scores first if the model has one (CLIP does, LightningDOT not)."""
    _check_square(scores, "contrastive_loss")
    targets = torch.arange(scores.shape[0], device=scores.device)  # (B,)
    return (F.cross_entropy(scores, targets) + F.cross_entropy(scores.t(), targets)) / 2


def distillation_loss(student_scores: torch.Tensor, teacher_scores: torch.Tensor,
                      tau: float = 1.0, reduction: str = "mean") -> torch.Tensor:
    """Fast & Slow distillation (Miech et al. 2021, eq. 5-7): the student learns the teacher's
    ranking. Both score matrices are (n_images, n_texts). Per text (column) the teacher gives
    p = softmax over images of teacher/tau (eq. 5), the student q = softmax of student/tau (eq. 6);
    the loss is H(p, q) = -sum_images p log q, averaged over texts ("mean") or summed as in eq. 7
    ("sum"). The teacher is detached (not trained). The paper uses tau = 10 and adds alpha * the
    dual-encoder loss with alpha / tau**2 = 0.001."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (eq. 7 sums), got {reduction!r}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0 (it divides the scores), got {tau}")
    if student_scores.dim() != 2 or student_scores.shape != teacher_scores.shape:
        raise ValueError(
            f"student and teacher scores must be the same (n_images, n_texts) matrix, got "
            f"{tuple(student_scores.shape)} and {tuple(teacher_scores.shape)}; score the same "
            "images and texts with both models")
    teacher = teacher_scores.detach().to(student_scores.dtype)
    teacher_p = torch.softmax(teacher / tau, dim=0)  # (N, T)
    student_log_q = torch.log_softmax(student_scores / tau, dim=0)  # (N, T)
    # Where the teacher gives probability 0 the term is 0 even if log q = -inf (masked scores).
    per_text = -(teacher_p * student_log_q.masked_fill(teacher_p == 0, 0)).sum(dim=0)  # (T,)
    return per_text.mean() if reduction == "mean" else per_text.sum()


class HingeTripletLoss(nn.Module):
    """`hinge_triplet_loss` with its margin and max_violation held by the module."""

    def __init__(self, margin: float = 0.2, max_violation: bool = True):
        super().__init__()
        self.margin = margin
        self.max_violation = max_violation

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return hinge_triplet_loss(scores, self.margin, self.max_violation)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, max_violation={self.max_violation}"


class ContrastiveLoss(nn.Module):
    """`contrastive_loss` of `logit_scale * scores`; the scale is fixed or learnable. The default 1
    is LightningDOT's plain CMR. CLIP learns the scale from 1/0.07; like CLIP we store its log (so
    it stays positive) and cap it at `max_scale`."""

    def __init__(self, logit_scale: float = 1.0, learnable: bool = False,
                 max_scale: float = 100.0):
        super().__init__()
        if not 0 < logit_scale <= max_scale:
            raise ValueError(f"logit_scale must be in (0, max_scale={max_scale}], got "
                             f"{logit_scale}")
        log_scale = torch.tensor(math.log(logit_scale))
        if learnable:
            self.log_logit_scale = nn.Parameter(log_scale)
        else:
            self.register_buffer("log_logit_scale", log_scale)
        self.max_scale = max_scale

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.log_logit_scale.exp().clamp(max=self.max_scale)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return contrastive_loss(self.logit_scale * scores)

    def extra_repr(self) -> str:
        learnable = isinstance(self.log_logit_scale, nn.Parameter)
        return f"logit_scale={self.logit_scale.item():.4g}, learnable={learnable}"


class DistillationLoss(nn.Module):
    """`distillation_loss` with its temperature and reduction held by the module."""

    def __init__(self, tau: float = 1.0, reduction: str = "mean"):
        super().__init__()
        self.tau = tau
        self.reduction = reduction

    def forward(self, student_scores: torch.Tensor, teacher_scores: torch.Tensor) -> torch.Tensor:
        return distillation_loss(student_scores, teacher_scores, self.tau, self.reduction)

    def extra_repr(self) -> str:
        return f"tau={self.tau}, reduction={self.reduction!r}"


def listwise_loss(scores: torch.Tensor, text_image: torch.Tensor) -> torch.Tensor:
    """`contrastive_loss` for a batch whose images may hold several of its texts: a listwise
    image-text matching loss for any scorer (a cross-encoder scores the (N, T) grid pair by pair).
    scores: (N, T), rows the batch's distinct images, columns its texts; text_image (T,): each
    text's image row. Text j: cross-entropy over the N images, target text_image[j]. Image i with
    its text j: cross-entropy over the T texts, i's other texts left out (not negatives), target j.
    Each direction is a mean over the T positive pairs, the loss their average: with N = T and
    text_image = arange(T) it equals `contrastive_loss`."""
    if scores.dim() != 2 or text_image.shape != scores.shape[1:]:
        raise ValueError(f"scores must be (N images, T texts) and text_image (T,), got shapes "
                         f"{tuple(scores.shape)} and {tuple(text_image.shape)}")
    T = scores.shape[1]
    text_image = text_image.to(scores.device).long()  # (T,)
    texts = torch.arange(T, device=scores.device)  # (T,)
    t2i = F.cross_entropy(scores.t(), text_image)  # (T, N) rows: per text over images
    rows = scores[text_image]  # (T, T): row j = image of text j against every text
    same_image = text_image[:, None] == text_image[None, :]  # (T, T): texts sharing j's image
    others = same_image & (texts[:, None] != texts[None, :])  # ... except text j itself
    i2t = F.cross_entropy(rows.masked_fill(others, float("-inf")), texts)
    return (t2i + i2t) / 2


def joint_nce_loss(scores: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Fast & Slow's dual-encoder NCE loss (Miech et al. 2021, eq. 4): in-batch, one denominator.
    scores: (B, B), rows images, columns texts, positives on the diagonal. For pair i: -log
    e^{S[i,i]} / (e^{S[i,i]} + sum_{j != i} e^{S[i,j]} + sum_{j != i} e^{S[j,i]}): the negatives
    N_i are every in-batch pair sharing image i or text i (MIL-NCE's set, the paper's [48]) in ONE
    softmax, where contrastive_loss averages two. No temperature (the paper has none). Mean over
    the B pairs, or "sum" as eq. 4 writes it."""
    _check_square(scores, "joint_nce_loss")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (eq. 4 sums), got {reduction!r}")
    is_positive = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    # row i: image i's texts (its positive included); column i with the positive masked: text i's
    # other images, so e^{S[i,i]} is counted once
    other_images = scores.t().masked_fill(is_positive, float("-inf"))  # (B, B)
    both = torch.cat([scores, other_images], dim=1)  # (B, 2B)
    per_pair = torch.logsumexp(both, dim=1) - scores.diagonal()  # (B,)
    return per_pair.mean() if reduction == "mean" else per_pair.sum()


class JointNCELoss(nn.Module):
    """`joint_nce_loss` with its reduction held by the module."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return joint_nce_loss(scores, self.reduction)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


# ----------------------------------------------------------------------------- masked words
# LightningDOT's VMLM (eq. 2), which HiVLP's LRM reuses: BERT masking, a prediction head over words

IGNORE = -100  # label of words that are not masked (F.cross_entropy's ignore_index)


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int,
                mask_prob: float = 0.15, generator: torch.Generator | None = None,
                special: SpecialTokens = WORD_SPECIAL_TOKENS):
    """BERT masking of real words: returns (masked_ids, labels), both (B, T).
    Each word is picked with probability mask_prob; special tokens (special.all: [CLS], [SEP],
    [PAD], [UNK], ...) never are. A picked word becomes [MASK] 80% of the time, a random word 10%
    (uniform over the non-special ids below vocab_size), itself 10%. A caption with no word picked
    gets its *first* word picked and replaced by [MASK], as UNITER's `random_word` does
    (`output_label[0] = tokens[0]; tokens[0] = mask`; LightningDOT's code copies it). labels hold
    the original id at picked positions, IGNORE elsewhere. special: SpecialTokens.of(the tokenizer
    that made input_ids); default the word tokenizer's."""
    if special.mask is None:
        raise ValueError("masking needs a [MASK] token, and this tokenizer has none")
    device = input_ids.device
    specials = torch.tensor(special.all, dtype=input_ids.dtype, device=device)  # (S,)
    real = attention_mask.bool() & ~torch.isin(input_ids, specials)  # (B, T) the words
    u = torch.rand(input_ids.shape, generator=generator, device=device)
    picked = real & (u < mask_prob)  # (B, T)
    none = real.any(1) & ~picked.any(1)  # captions with words but nothing picked: UNITER's rule
    first = real & (real.cumsum(1) == 1)  # (B, T) each caption's first real word
    forced = first & none.unsqueeze(1)  # (B, T) the forced picks: always [MASK] (below)
    picked = picked | forced
    labels = torch.where(picked, input_ids, torch.full_like(input_ids, IGNORE))
    action = torch.rand(input_ids.shape, generator=generator, device=input_ids.device)
    word_ids = special.word_ids(vocab_size, device)  # (V - S,) the non-special ids
    random_words = word_ids[torch.randint(len(word_ids), input_ids.shape, generator=generator,
                                          device=device)]  # (B, T)
    masked = input_ids.clone()
    masked[picked & ((action < 0.8) | forced)] = special.mask
    swap = picked & ~forced & (action >= 0.8) & (action < 0.9)
    masked[swap] = random_words[swap]
    return masked, labels  # the last 10% keep their word


def prediction_head(hidden: int, out: int) -> nn.Sequential:
    """BERT's prediction head shape: Linear, GELU, LayerNorm, Linear."""
    return nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden),
                         nn.Linear(hidden, out))


def fuse_cls(states: torch.Tensor, other_cls: torch.Tensor, fuse: bool) -> torch.Tensor:
    """states (B, L, H) + the other modality's [CLS] (B, H) broadcast over L, or states alone."""
    return states + other_cls.unsqueeze(1) if fuse else states


class VMLM(nn.Module):
    """Eq. 2: -1/M sum_k log P(w_mk | z_mk + h0). forward(word_states (B, T, H), image_cls (B, H),
    labels (B, T) with IGNORE at unmasked words) -> mean cross-entropy over the masked words."""

    def __init__(self, hidden: int, vocab_size: int, fuse: bool = True):
        super().__init__()
        self.head, self.fuse = prediction_head(hidden, vocab_size), fuse

    def forward(self, word_states, image_cls, labels) -> torch.Tensor:
        picked = labels != IGNORE  # (B, T)
        logits = self.head(fuse_cls(word_states, image_cls, self.fuse)[picked])  # (M, V)
        return F.cross_entropy(logits, labels[picked])
