"""Checkers of lesson 04: U-BERT's enhanced similarity (eq. 15), stage 2 one candidate at a time."""

from functools import partial

import torch
import torch.nn.functional as F

from course_lib.methods.ubert.model import enhanced_similarity, rescore_candidates

from .errors import ExerciseError, check_answer, float64


def _eq15_cases(seed: int = 0):
    """(label, [I_intra, T_intra, I_inter, T_inter] (P, H) float64 each, alpha)."""
    generator = torch.Generator().manual_seed(seed)

    def parts(P, H, unit):
        vectors = [torch.randn(P, H, generator=generator, dtype=torch.float64) for _ in range(4)]
        if unit:
            return [F.normalize(v, dim=-1) for v in vectors]
        return [v * (0.2 + 3 * torch.rand(P, 1, generator=generator, dtype=torch.float64))
                for v in vectors]

    yield "6 pairs of unit vectors, alpha 0.5", parts(6, 8, True), 0.5
    yield "6 pairs of unit vectors, alpha 0.3", parts(6, 8, True), 0.3
    yield "5 pairs of unnormalised vectors, alpha 0.5", parts(5, 8, False), 0.5
    yield "4 pairs of unnormalised vectors, alpha 2.0", parts(4, 16, False), 2.0
    yield "a single pair of unit vectors, alpha 0.5", parts(1, 8, True), 0.5


def _eq15_mistakes(image_intra, text_intra, image_inter, text_inter, alpha) -> list:
    """(scores (P,), what to tell the learner) of the usual wrong versions of eq. 15."""
    cos, unit = partial(F.cosine_similarity, dim=-1), partial(F.normalize, dim=-1)
    image, text = alpha * image_intra + image_inter, alpha * text_intra + text_inter  # (P, H) each
    unit_image = alpha * unit(image_intra) + unit(image_inter)  # (P, H)
    unit_text = alpha * unit(text_intra) + unit(text_inter)  # (P, H)
    return [
        ((image * text).sum(-1), "you returned the dot product of the two sums: the sums were "
         "not normalised. Eq. 15 is their cosine: divide by the norms of alpha*I_intra + I_inter "
         "and alpha*T_intra + T_inter (a sum of two unit vectors is not a unit vector)"),
        ((unit_image * unit_text).sum(-1), "you normalised the four parts but not their sums; "
         "eq. 15 is the cosine of the sums: divide by the norms of alpha*I_intra + I_inter and "
         "alpha*T_intra + T_inter"),
        (cos(image_intra + alpha * image_inter, text_intra + alpha * text_inter),
         "alpha multiplies the inter-modal part; in eq. 15 it weighs the intra-modal part: "
         "alpha*I_intra + I_inter (and alpha*T_intra + T_inter)"),
        (alpha * cos(image_intra, text_intra) + cos(image_inter, text_inter),
         "you added two cosines (intra with intra, inter with inter); eq. 15 is one cosine "
         "between the two sums"),
        (cos(unit_image, unit_text), "you L2-normalised the four inputs again; the model hands "
         "them over already normalised (§4.1), so take them as they come: only the two sums are "
         "normalised, by the cosine itself"),
        (cos(image_intra, text_intra), "this is s1 (eq. 14), the intra-modal cosine: the "
         "inter-modal parts are missing"),
        (cos(image_inter, text_inter), "only the inter-modal parts are there: add alpha times the "
         "intra-modal ones"),
    ]


def check_enhanced_similarity(fn) -> None:
    """fn(image_intra, text_intra, image_inter, text_inter, alpha) -> (P,) eq. 15 for P aligned
    pairs: cos(alpha * I_intra + I_inter, alpha * T_intra + T_inter)."""
    for label, parts, alpha in _eq15_cases():
        P = parts[0].shape[0]
        expected = enhanced_similarity(*parts, alpha=alpha)  # (P,)
        got = float64(fn(*(p.clone() for p in parts), alpha=alpha))
        if got.dim() == 2 and got.shape[0] == got.shape[1] == P and P > 1:
            raise ExerciseError(f"on {label}: you returned a ({P}, {P}) matrix, every image "
                                "against every caption; eq. 15 is per pair here: row p of the "
                                f"image inputs with row p of the text inputs -> ({P},). Take the "
                                "cosine along the last axis, not a matrix product")
        shape = f"on {label}: expected shape ({P},), one score per pair, got {tuple(got.shape)}"
        if got.numel() == P and tuple(got.shape) != (P,):
            raise ExerciseError(f"{shape}: drop the extra axis (keepdim=False, or .squeeze(-1))")
        if tuple(got.shape) != (P,):
            raise ExerciseError(shape)
        check_answer(got, expected, label, "scores differ from eq. 15 by up to {worst:.3g}; eq. 15 "
                     "is cos(alpha*I_intra + I_inter, alpha*T_intra + T_inter), one number per "
                     "pair", _eq15_mistakes, *parts, alpha)
    print("enhanced similarity (eq. 15): correct (unit and unnormalised inputs, alpha from 0.3 to "
          "2, 1 to 6 pairs)")


def check_rerank_one_by_one(fn, model, query, gallery, atol: float = 1e-5) -> None:
    """fn(model, query, gallery) -> (K,) s2 of one query against its K candidates, one at a time.
    query: (tokens (1, L, H), mask (1, L), T_intra (1, H)); gallery: (tokens (K, M, H),
    masks (K, M), I_intra (K, H)), as UBERTStates.text / .image give them."""
    K, was_training = gallery[2].shape[0], model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = rescore_candidates(model, query, gallery).float().cpu()  # (K,)
            try:
                got = fn(model, query, gallery)
            except Exception as error:  # the learner's bug: say where to look, keep the traceback
                raise ExerciseError(f"your function raised {type(error).__name__}: {error}. "
                                    "model.s2 takes batches: candidate k is tuple(s[k:k + 1] for s "
                                    "in gallery), a batch of one (s[k] drops the batch axis), "
                                    "paired with the query as it is") from error
    finally:
        model.train(was_training)
    if isinstance(got, (list, tuple)):
        raise ExerciseError(f"you returned a {type(got).__name__} of {len(got)} items; return one "
                            f"({K},) tensor: torch.cat the (1,) scores of the candidates")
    if not torch.is_tensor(got):
        raise ExerciseError(f"return a torch tensor of shape ({K},), got {type(got).__name__}")
    got = got.detach().float().cpu()
    if tuple(got.shape) != (K,):
        hint = (" (torch.cat the (1,) pieces, or .squeeze() a stack of them)" if got.numel() == K
                else f": one score for each of the {K} candidates")
        raise ExerciseError(f"expected shape ({K},), got {tuple(got.shape)}{hint}")
    worst = (got - expected).abs().max().item()
    if worst <= atol:
        print(f"rerank one by one: correct ({K} candidates, largest difference from "
              f"rescore_candidates {worst:.1e})")
        return
    if torch.allclose(got.sort().values, expected.sort().values, atol=atol):
        raise ExerciseError("the right scores in another order: return them in the candidates' "
                            "order (score k belongs to gallery row k); the cascade sorts them "
                            "afterwards")
    if K > 1 and torch.allclose(got, expected[:1].expand(K), atol=atol):
        raise ExerciseError("every score is candidate 0's: index the gallery with the loop "
                            "variable, tuple(s[k:k + 1] for s in gallery)")
    s1 = gallery[2].float().cpu() @ query[2].float().cpu()[0]  # (K,) cosines of unit intra vectors
    if torch.allclose(got, s1, atol=atol):
        raise ExerciseError("these are the stage-1 scores s1 = cos(I_intra, T_intra) (eq. 14); "
                            "stage 2 is model.s2(candidate, query) (eq. 15), which runs BERT_cross "
                            "on the pair")
    raise ExerciseError(f"scores differ from rescore_candidates by up to {worst:.3g} (tolerance "
                        f"{atol}); for each k: model.s2(tuple(s[k:k + 1] for s in gallery), "
                        "query), then torch.cat")
