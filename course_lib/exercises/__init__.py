"""Checkers for the notebooks' exercises: each runs the learner's function on cases with
known answers and says what is wrong in words (the usual mistakes first), or that it passes.

The reference answers come from `course_lib.core.metrics`, so an exercise checks the learner against
the same tested code the rest of the course uses.
"""

from .attention import check_func_attention
from .errors import ExerciseError
from .fast_slow import check_score_one_caption, check_summed_log_likelihood
from .frontier import check_pareto_front
from .hivlp import check_hrl_loss
from .pretraining import check_cmr_loss, check_mask_tokens
from .ranking import check_hinge_loss, check_i2t_ranks, check_t2i_ranks
from .real_photos import check_chance_recall
from .serving import check_faster_query
from .timing import check_latency_rows, check_top_k
from .ubert import check_enhanced_similarity, check_rerank_one_by_one

__all__ = ["ExerciseError", "check_t2i_ranks", "check_i2t_ranks", "check_hinge_loss", "check_func_attention",
           "check_cmr_loss", "check_mask_tokens", "check_enhanced_similarity", "check_rerank_one_by_one",
           "check_hrl_loss", "check_summed_log_likelihood", "check_score_one_caption",
           "check_pareto_front", "check_latency_rows", "check_top_k", "check_faster_query", "check_chance_recall"]
