"""Checkers for the notebooks' exercises: each runs the learner's function on cases with
known answers and says what is wrong in words (the usual mistakes first), or that it passes.

The reference answers come from `course_lib.core.metrics`, so an exercise checks the learner against
the same tested code the rest of the course uses. One module per lesson's exercises (ranking, attention,
pretraining, ubert, hivlp, fast_slow, frontier, timing, serving, real_photos; ExerciseError in errors):
a notebook imports its checker from that module.
"""
