"""Tests for course_lib.core.losses: loop references, hand-worked numbers, gradients and errors."""

from __future__ import annotations

import math

import pytest
import torch

from course_lib.core.losses import (
    ContrastiveLoss,
    DistillationLoss,
    HingeTripletLoss,
    JointNCELoss,
    contrastive_loss,
    distillation_loss,
    hinge_triplet_loss,
    joint_nce_loss,
)


# --------------------------------------------------------------------------------------- references
def loop_hinge(S: list[list[float]], margin: float, max_violation: bool) -> float:
    """VSE++ hinge with one Python loop per query, directly from the paper's formula."""
    B = len(S)
    total = 0.0
    for i in range(B):  # image i as the query: wrong texts j
        hinges = [max(0.0, margin + S[i][j] - S[i][i]) for j in range(B) if j != i]
        total += (max(hinges) if max_violation else sum(hinges)) if hinges else 0.0
    for j in range(B):  # text j as the query: wrong images i
        hinges = [max(0.0, margin + S[i][j] - S[j][j]) for i in range(B) if i != j]
        total += (max(hinges) if max_violation else sum(hinges)) if hinges else 0.0
    return total


def loop_cross_entropy(logits: list[float], target: int) -> float:
    return -(logits[target] - math.log(sum(math.exp(x) for x in logits)))


def loop_contrastive(S: list[list[float]]) -> float:
    B = len(S)
    rows = sum(loop_cross_entropy(S[i], i) for i in range(B)) / B
    cols = sum(loop_cross_entropy([S[i][j] for i in range(B)], j) for j in range(B)) / B
    return (rows + cols) / 2


def loop_distillation(student, teacher, tau: float, reduction: str) -> float:
    n_images, n_texts = len(student), len(student[0])
    per_text = []
    for j in range(n_texts):
        t = [math.exp(teacher[i][j] / tau) for i in range(n_images)]
        s = [math.exp(student[i][j] / tau) for i in range(n_images)]
        p = [x / sum(t) for x in t]
        q = [x / sum(s) for x in s]
        per_text.append(-sum(p[i] * math.log(q[i]) for i in range(n_images)))
    return sum(per_text) / n_texts if reduction == "mean" else sum(per_text)


def random_scores(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -------------------------------------------------------------------------------------------- hinge
def test_hinge_hand_worked_3x3():
    S = torch.tensor([[0.9, 0.5, 0.8],
                      [0.6, 0.4, 0.1],
                      [0.2, 0.3, 0.7]], dtype=torch.float64)
    # margin 0.2, positives 0.9 / 0.4 / 0.7 on the diagonal.
    # image rows:  row 0: 0.2+0.5-0.9 < 0 -> 0, 0.2+0.8-0.9 = 0.1   (max 0.1, sum 0.1)
    #              row 1: 0.2+0.6-0.4 = 0.4, 0.2+0.1-0.4 < 0 -> 0   (max 0.4, sum 0.4)
    #              row 2: 0.2+0.2-0.7, 0.2+0.3-0.7 both < 0         (max 0,   sum 0)
    # text cols:   col 0: 0.2+0.6-0.9, 0.2+0.2-0.9 both < 0         (max 0,   sum 0)
    #              col 1: 0.2+0.5-0.4 = 0.3, 0.2+0.3-0.4 = 0.1      (max 0.3, sum 0.4)
    #              col 2: 0.2+0.8-0.7 = 0.3, 0.2+0.1-0.7 < 0 -> 0   (max 0.3, sum 0.3)
    # sum of hinges = 0.1+0.4+0.4+0.3 = 1.2; max violation = 0.1+0.4+0.3+0.3 = 1.1
    assert hinge_triplet_loss(S, margin=0.2, max_violation=False).item() == pytest.approx(1.2)
    assert hinge_triplet_loss(S, margin=0.2, max_violation=True).item() == pytest.approx(1.1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("margin", [0.0, 0.2, 1.0])
def test_hinge_matches_loops_and_max_is_below_sum(seed, margin):
    S = random_scores(7, 7, seed=seed)
    hard = hinge_triplet_loss(S, margin, max_violation=True)
    summed = hinge_triplet_loss(S, margin, max_violation=False)
    assert hard.item() == pytest.approx(loop_hinge(S.tolist(), margin, True))
    assert summed.item() == pytest.approx(loop_hinge(S.tolist(), margin, False))
    assert hard.dim() == 0 and hard.item() <= summed.item() + 1e-12


def test_hinge_gradients_flow():
    S = random_scores(5, 5, seed=1).requires_grad_(True)
    hinge_triplet_loss(S, margin=0.5).backward()
    assert S.grad is not None and S.grad.abs().sum() > 0
    # Raising a positive lowers the loss: its gradient is never positive.
    assert (S.grad.diagonal() <= 0).all()


# -------------------------------------------------------------------------------------- contrastive
def test_contrastive_hand_worked_2x2():
    S = torch.tensor([[2.0, 0.0],
                      [1.0, 1.0]])
    # rows:    image 0 -> -log(e^2 / (e^2 + e^0)) = log(1 + e^-2) = 0.126928
    #          image 1 -> scores (1, 1), target 1 -> log 2 = 0.693147; mean 0.410038
    # columns: text 0  -> (2, 1), target 0 -> log(1 + e^-1) = 0.313262
    #          text 1  -> (0, 1), target 1 -> log(1 + e^-1) = 0.313262; mean 0.313262
    # loss = (0.410038 + 0.313262) / 2 = 0.361650
    expected = ((math.log1p(math.exp(-2)) + math.log(2)) / 2 + math.log1p(math.exp(-1))) / 2
    assert expected == pytest.approx(0.361650, abs=1e-6)
    assert contrastive_loss(S).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_contrastive_matches_loops_and_has_gradients(seed):
    S = (3 * random_scores(6, 6, seed=seed)).requires_grad_(True)
    loss = contrastive_loss(S)
    assert loss.item() == pytest.approx(loop_contrastive(S.tolist()))
    loss.backward()
    assert (S.grad.diagonal() < 0).all()  # pushing a positive up always helps
    assert torch.autograd.gradcheck(contrastive_loss, (S.detach().clone().requires_grad_(True),))


def test_contrastive_module_scale():
    S = random_scores(4, 4, seed=2)
    assert ContrastiveLoss()(S).item() == pytest.approx(contrastive_loss(S).item())
    fixed = ContrastiveLoss(logit_scale=10.0)
    assert fixed(S).item() == pytest.approx(contrastive_loss(10 * S).item())
    assert list(fixed.parameters()) == []  # a fixed scale is a buffer, not trained
    learnable = ContrastiveLoss(logit_scale=1 / 0.07, learnable=True)
    assert learnable.logit_scale.item() == pytest.approx(1 / 0.07)
    learnable(S).backward()
    assert learnable.log_logit_scale.grad is not None
    with torch.no_grad():
        learnable.log_logit_scale.fill_(math.log(1000.0))
    assert learnable.logit_scale.item() == pytest.approx(100.0)  # capped like CLIP
    with pytest.raises(ValueError, match="logit_scale"):
        ContrastiveLoss(logit_scale=0.0)


# ------------------------------------------------------------------------------------- distillation
def test_distillation_hand_worked():
    # 2 images x 1 text. Teacher (0, 0) -> p = (1/2, 1/2); student (log 3, 0) -> q = (3/4, 1/4).
    # H(p, q) = -(1/2 log 3/4 + 1/2 log 1/4) = (0.287682 + 1.386294) / 2 = 0.836988
    teacher = torch.tensor([[0.0], [0.0]])
    student = torch.tensor([[math.log(3.0)], [0.0]])
    assert distillation_loss(student, teacher).item() == pytest.approx(0.836988, abs=1e-6)


@pytest.mark.parametrize("tau", [0.5, 1.0, 10.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_distillation_matches_loops(tau, reduction):
    student, teacher = random_scores(5, 8, seed=3), 4 * random_scores(5, 8, seed=4)
    got = distillation_loss(student, teacher, tau=tau, reduction=reduction).item()
    assert got == pytest.approx(loop_distillation(student.tolist(), teacher.tolist(),
                                                  tau, reduction))


def test_distillation_equals_teacher_entropy_when_student_is_teacher():
    teacher = random_scores(6, 4, seed=5)
    p = torch.softmax(teacher, dim=0)
    entropy = -(p * p.log()).sum(dim=0).mean()
    assert distillation_loss(teacher.clone(), teacher).item() == pytest.approx(entropy.item())
    # and the student's gradient vanishes there: p is the minimiser of H(p, q) over q.
    student = teacher.clone().requires_grad_(True)
    distillation_loss(student, teacher).backward()
    assert student.grad.abs().max().item() < 1e-12


def test_distillation_temperature_matters_and_teacher_gets_no_gradient():
    student = random_scores(4, 4, seed=6).requires_grad_(True)
    teacher = random_scores(4, 4, seed=7).requires_grad_(True)
    loss_1 = distillation_loss(student, teacher, tau=1.0)
    loss_10 = distillation_loss(student, teacher, tau=10.0)
    assert loss_1.item() != pytest.approx(loss_10.item())
    (loss_1 + loss_10).backward()
    assert teacher.grad is None
    assert student.grad is not None and student.grad.abs().sum() > 0


def test_distillation_masked_candidates_give_no_nan():
    # A -inf score (a masked candidate) in both models contributes 0, not NaN.
    scores = torch.tensor([[1.0, 0.0], [-math.inf, 2.0]])
    loss = distillation_loss(scores.clone().requires_grad_(True), scores)
    assert torch.isfinite(loss)


def test_distillation_rectangular_and_sum_is_n_texts_times_mean():
    student, teacher = random_scores(3, 7, seed=8), random_scores(3, 7, seed=9)
    mean = distillation_loss(student, teacher, reduction="mean")
    total = distillation_loss(student, teacher, reduction="sum")
    assert total.item() == pytest.approx(7 * mean.item())


# ---------------------------------------------------------------------------------- modules, errors
def test_modules_equal_functions():
    S, T = random_scores(5, 5, seed=10), random_scores(5, 5, seed=11)
    assert (HingeTripletLoss(0.3, False)(S).item()
            == pytest.approx(hinge_triplet_loss(S, 0.3, False).item()))
    assert DistillationLoss(2.0, "sum")(S, T).item() == pytest.approx(
        distillation_loss(S, T, 2.0, "sum").item())
    assert "margin=0.3" in repr(HingeTripletLoss(0.3)) and "tau=2.0" in repr(DistillationLoss(2.0))


@pytest.mark.parametrize("loss_fn", [hinge_triplet_loss, contrastive_loss])
@pytest.mark.parametrize("shape", [(3, 4), (4,), (2, 2, 2)])
def test_square_losses_reject_other_shapes(loss_fn, shape):
    with pytest.raises(ValueError, match=r"square \(B, B\)"):
        loss_fn(torch.zeros(shape))


def test_distillation_errors():
    with pytest.raises(ValueError, match="same .* matrix"):
        distillation_loss(torch.zeros(3, 4), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="same .* matrix"):
        distillation_loss(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="reduction must be"):
        distillation_loss(torch.zeros(2, 2), torch.zeros(2, 2), reduction="none")
    with pytest.raises(ValueError, match="tau must be > 0"):
        distillation_loss(torch.zeros(2, 2), torch.zeros(2, 2), tau=0.0)


def test_hinge_name_names_both_variants_in_method_notes():
    from course_lib.core.losses import hinge_name
    from course_lib.methods.scan.method import SCANMethod
    from course_lib.methods.scan.model import SCANConfig
    from course_lib.methods.vsepp import VsePPConfig, VsePPMethod

    assert (hinge_name(True), hinge_name(False)) == ("max-violation hinge", "sum of hinges")
    assert "sum of hinges" in VsePPMethod(VsePPConfig(max_violation=False)).notes
    assert "max-violation hinge" in SCANMethod(SCANConfig(max_violation=True)).notes


# ------------------------------------------------------------------------------------ listwise_loss
def loop_listwise(S: list[list[float]], text_image: list[int]) -> float:
    """listwise_loss with Python loops: per text a softmax over every image, per (image, own text)
    a softmax over that text and the texts of other images."""
    N, T = len(S), len(S[0])
    t2i = [-(S[text_image[j]][j] - math.log(sum(math.exp(S[i][j]) for i in range(N))))
           for j in range(T)]
    i2t = []
    for j in range(T):
        i = text_image[j]
        pool = [k for k in range(T) if k == j or text_image[k] != i]
        i2t.append(-(S[i][j] - math.log(sum(math.exp(S[i][k]) for k in pool))))
    return (sum(t2i) / T + sum(i2t) / T) / 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_listwise_matches_loops_with_shared_images(seed):
    from course_lib.core.losses import listwise_loss

    gen = torch.Generator().manual_seed(seed)
    text_image = torch.tensor([0, 1, 1, 2, 0, 3, 1])  # image 1 holds three texts, image 0 two
    S = (3 * torch.randn(4, 7, generator=gen, dtype=torch.float64)).requires_grad_()
    loss = listwise_loss(S, text_image)
    assert loss.item() == pytest.approx(loop_listwise(S.tolist(), text_image.tolist()), rel=1e-9)
    loss.backward()
    assert torch.isfinite(S.grad).all() and S.grad.abs().sum() > 0


def test_listwise_is_contrastive_when_every_image_has_one_text():
    from course_lib.core.losses import listwise_loss

    S = torch.randn(5, 5, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(listwise_loss(S, torch.arange(5)), contrastive_loss(S))
    # a permutation of the columns with its text_image gives the same loss
    perm = torch.tensor([2, 0, 4, 1, 3])
    assert torch.allclose(listwise_loss(S[:, perm], perm), contrastive_loss(S))
    with pytest.raises(ValueError, match="text_image"):
        listwise_loss(S, torch.arange(4))


def test_batch_scores_is_the_feature_product_and_checks_shapes():
    from course_lib.core.losses import batch_scores

    g = torch.Generator().manual_seed(0)
    image, text = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    expected = torch.tensor([[float(sum(image[i, e] * text[j, e] for e in range(3)))
                              for j in range(4)]
                             for i in range(4)])
    torch.testing.assert_close(batch_scores(image, text), expected)
    with pytest.raises(ValueError, match="both be"):
        batch_scores(image, text[:3])


# -------------------------------------------------------------------------------- Fast & Slow eq. 4
def loop_joint_nce(S: list[list[float]]) -> float:
    """Eq. 4 written out: per pair i, e^{S_ii} over itself and each pair sharing image or text i."""
    B, total = len(S), 0.0
    for i in range(B):
        denominator = math.exp(S[i][i])
        denominator += sum(math.exp(S[i][j]) for j in range(B) if j != i)  # image i, other texts
        denominator += sum(math.exp(S[j][i]) for j in range(B) if j != i)  # text i, other images
        total += -math.log(math.exp(S[i][i]) / denominator)
    return total


def test_joint_nce_against_a_loop():
    g = torch.Generator().manual_seed(3)
    for B in (1, 2, 5):
        S = 4 * torch.randn(B, B, generator=g, dtype=torch.float64)
        expected = loop_joint_nce(S.tolist())
        assert joint_nce_loss(S, reduction="sum").item() == pytest.approx(expected, rel=1e-9)
        assert joint_nce_loss(S).item() == pytest.approx(expected / B, rel=1e-9)
        assert JointNCELoss("sum")(S).item() == pytest.approx(expected, rel=1e-9)


def test_joint_nce_by_hand_and_differs_from_the_two_softmaxes():
    # all scores 0, B = 3: each pair's denominator holds 1 + 2 + 2 = 5 terms -> log 5 per pair
    assert joint_nce_loss(torch.zeros(3, 3)).item() == pytest.approx(math.log(5), abs=1e-6)
    assert contrastive_loss(torch.zeros(3, 3)).item() == pytest.approx(math.log(3), abs=1e-6)
    with pytest.raises(ValueError, match="square"):
        joint_nce_loss(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="reduction"):
        joint_nce_loss(torch.zeros(2, 2), reduction="max")


def test_joint_nce_large_scores_stay_finite_and_gradients_match_a_loop():
    S = torch.tensor([[300.0, 1.0], [2.0, -400.0]], dtype=torch.float64, requires_grad=True)
    loss = joint_nce_loss(S, reduction="sum")
    assert torch.isfinite(loss)
    loss.backward()
    small = torch.tensor([[0.3, 0.1], [0.2, -0.4]], dtype=torch.float64, requires_grad=True)
    joint_nce_loss(small, reduction="sum").backward()
    eps, numeric = 1e-6, torch.zeros(2, 2, dtype=torch.float64)
    for i in range(2):
        for j in range(2):
            up, down = small.detach().clone(), small.detach().clone()
            up[i, j] += eps
            down[i, j] -= eps
            numeric[i, j] = (loop_joint_nce(up.tolist())
                             - loop_joint_nce(down.tolist())) / (2 * eps)
    assert torch.allclose(small.grad, numeric, atol=1e-6)

