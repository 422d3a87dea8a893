"""Checkers for the notebooks' exercises: each runs the learner's function on cases with known
answers and says what is wrong in words (the usual mistakes first), or that it passes.

The reference answers come from the library's tested code, the same the rest of the course uses.
One module per lesson's exercises (ranking, attention, pretraining, ubert, hivlp, fast_slow,
frontier, timing, serving, real_photos; ExerciseError in errors), whence a notebook imports them.
"""
