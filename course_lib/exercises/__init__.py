"""Checkers for the notebooks' exercises: each runs the learner's function on cases with known
answers (from the library's tested code) and says what is wrong in words, or that it passes."""
