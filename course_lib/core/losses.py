"""Training losses on a score matrix: VSE++ hinge, LightningDOT/CLIP contrastive, Fast & Slow
distillation and NCE, and LightningDOT's masked-word objective. Scores `S[i, j]` are of image i
(rows) and text j (columns), so a loss serves a dual encoder, SCAN or a cross-encoder alike; the
in-batch losses take a square S, positives on the diagonal. The `nn.Module` wrappers only hold
hyper-parameters (open_clip style)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.core.tokens import WORD_SPECIAL_TOKENS, SpecialTokens


def _check_square(scores: torch.Tensor, name: str) -> None:
    if scores.dim() != 2 or scores.shape[0] != scores.shape[1]:
        raise ValueError(f"{name} needs a square (B, B) score matrix, positives on the diagonal, "
                         f"got {tuple(scores.shape)}: score a batch's B images against its B texts")


def batch_scores(image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
    """A dual encoder's in-batch scores: (B, E) @ (B, E).T -> (B, B). Formed here, not in the
    model, so a distributed run can gather every process's features first (open_clip's ClipLoss)."""
    if image_features.shape != text_features.shape or image_features.dim() != 2:
        raise ValueError(f"image and text features must both be (B, E), got "
                         f"{tuple(image_features.shape)} and {tuple(text_features.shape)}")
    return image_features @ text_features.T  # (B, B)


def hinge_triplet_loss(scores: torch.Tensor, margin: float = 0.2,
                       max_violation: bool = True) -> torch.Tensor:
    """VSE++'s bidirectional hinge loss on (B, B) scores, summed over the batch: [margin + S[i, j]
    - S[i, i]]_+ per wrong text j of image i, [margin + S[i, j] - S[j, j]]_+ per wrong image i of
    text j. max_violation: only each query's hardest negative (VSE++'s "MH"), else every hinge."""
    _check_square(scores, "hinge_triplet_loss")
    positives = scores.diagonal().view(-1, 1)  # (B, 1)
    is_positive = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)  # (B, B)
    # (B, B): wrong texts per image row, wrong images per column; a positive is not its own negative
    cost_text = (margin + scores - positives).clamp(min=0).masked_fill(is_positive, 0)
    cost_image = (margin + scores - positives.t()).clamp(min=0).masked_fill(is_positive, 0)
    if max_violation:
        return cost_text.max(dim=1).values.sum() + cost_image.max(dim=0).values.sum()
    return cost_text.sum() + cost_image.sum()


def hinge_name(max_violation: bool) -> str:
    """How method notes name hinge_triplet_loss's two variants."""
    return "max-violation hinge" if max_violation else "sum of hinges"


def contrastive_loss(scores: torch.Tensor) -> torch.Tensor:
    """LightningDOT's CMR / CLIP's loss on (B, B) logits: (CE over texts per image + CE over images
    per text) / 2, each a batch mean. No temperature: scale the scores first (CLIP does)."""
    _check_square(scores, "contrastive_loss")
    targets = torch.arange(scores.shape[0], device=scores.device)  # (B,)
    return (F.cross_entropy(scores, targets) + F.cross_entropy(scores.t(), targets)) / 2


def distillation_loss(student_scores: torch.Tensor, teacher_scores: torch.Tensor,
                      tau: float = 1.0, reduction: str = "mean") -> torch.Tensor:
    """Fast & Slow distillation (Miech et al. 2021, eq. 5-7) of (n_images, n_texts) scores: per
    text, H(p, q) = -sum_images p log q with p = softmax(teacher / tau) over images (eq. 5, the
    teacher detached) and q = softmax(student / tau) (eq. 6); mean over texts, or "sum" (eq. 7).
    The paper uses tau = 10 and adds alpha * the dual-encoder loss, alpha / tau**2 = 0.001."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (eq. 7 sums), got {reduction!r}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0 (it divides the scores), got {tau}")
    if student_scores.dim() != 2 or student_scores.shape != teacher_scores.shape:
        raise ValueError(f"student and teacher scores must be the same (n_images, n_texts) matrix "
                         f"(of the same images and texts), got {tuple(student_scores.shape)} and "
                         f"{tuple(teacher_scores.shape)}")
    teacher = teacher_scores.detach().to(student_scores.dtype)
    teacher_p = torch.softmax(teacher / tau, dim=0)  # (N, T)
    student_log_q = torch.log_softmax(student_scores / tau, dim=0)  # (N, T)
    # where p = 0 the term is 0 even if log q = -inf (masked scores)
    per_text = -(teacher_p * student_log_q.masked_fill(teacher_p == 0, 0)).sum(dim=0)  # (T,)
    return per_text.mean() if reduction == "mean" else per_text.sum()


class HingeTripletLoss(nn.Module):
    def __init__(self, margin: float = 0.2, max_violation: bool = True):
        super().__init__()
        self.margin, self.max_violation = margin, max_violation

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return hinge_triplet_loss(scores, self.margin, self.max_violation)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, max_violation={self.max_violation}"


class ContrastiveLoss(nn.Module):
    """`contrastive_loss` of `logit_scale * scores`, the scale fixed (1: LightningDOT's CMR) or
    learnt as its log, capped at `max_scale` (CLIP starts from 1/0.07)."""

    def __init__(self, logit_scale: float = 1.0, learnable: bool = False, max_scale: float = 100.0):
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
    def __init__(self, tau: float = 1.0, reduction: str = "mean"):
        super().__init__()
        self.tau, self.reduction = tau, reduction

    def forward(self, student_scores: torch.Tensor, teacher_scores: torch.Tensor) -> torch.Tensor:
        return distillation_loss(student_scores, teacher_scores, self.tau, self.reduction)

    def extra_repr(self) -> str:
        return f"tau={self.tau}, reduction={self.reduction!r}"


def listwise_loss(scores: torch.Tensor, text_image: torch.Tensor) -> torch.Tensor:
    """`contrastive_loss` for scores (N distinct images, T texts), text_image (T,) each text's image
    row: per text, CE over the images and CE over the texts but its image's others (text_image =
    arange(T) gives `contrastive_loss`)."""
    if scores.dim() != 2 or text_image.shape != scores.shape[1:]:
        raise ValueError(f"scores must be (N images, T texts) and text_image (T,), got shapes "
                         f"{tuple(scores.shape)} and {tuple(text_image.shape)}")
    text_image = text_image.to(scores.device).long()  # (T,)
    texts = torch.arange(scores.shape[1], device=scores.device)  # (T,)
    t2i = F.cross_entropy(scores.t(), text_image)  # (T, N) rows: per text over images
    rows = scores[text_image]  # (T, T): row j = image of text j against every text
    same_image = text_image[:, None] == text_image[None, :]  # (T, T): texts sharing j's image
    others = same_image & (texts[:, None] != texts[None, :])  # ... except text j itself
    i2t = F.cross_entropy(rows.masked_fill(others, float("-inf")), texts)
    return (t2i + i2t) / 2


def joint_nce_loss(scores: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Fast & Slow's NCE loss (Miech et al. 2021, eq. 4) on (B, B) scores: for pair i, -log
    e^{S[i,i]} / (e^{S[i,i]} + sum_{j != i} e^{S[i,j]} + sum_{j != i} e^{S[j,i]}), ONE softmax
    over every pair sharing image i or text i (contrastive_loss averages two). Mean, or "sum"."""
    _check_square(scores, "joint_nce_loss")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum' (eq. 4 sums), got {reduction!r}")
    is_positive = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    # image i's texts, then text i's other images: e^{S[i,i]} counted once
    other_images = scores.t().masked_fill(is_positive, float("-inf"))  # (B, B)
    both = torch.cat([scores, other_images], dim=1)  # (B, 2B)
    per_pair = torch.logsumexp(both, dim=1) - scores.diagonal()  # (B,)
    return per_pair.mean() if reduction == "mean" else per_pair.sum()


class JointNCELoss(nn.Module):
    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return joint_nce_loss(scores, self.reduction)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}"


# LightningDOT's VMLM (eq. 2), which HiVLP's LRM reuses: BERT masking, a prediction head over words

IGNORE = -100  # label of words that are not masked (F.cross_entropy's ignore_index)


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int,
                mask_prob: float = 0.15, generator: torch.Generator | None = None,
                special: SpecialTokens = WORD_SPECIAL_TOKENS):
    """BERT masking of real words -> (masked_ids, labels), both (B, T), labels IGNORE where not
    picked. Each non-special word is picked with probability mask_prob and becomes [MASK] 80% of
    the time, a random non-special word 10%, itself 10%. A caption with none picked gets its
    *first* word masked, as UNITER's `random_word` (which LightningDOT copies)."""
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
