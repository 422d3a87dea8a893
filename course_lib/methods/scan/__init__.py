"""SCAN (Lee et al. 2018): stacked cross attention between words and regions.

attention.py: the similarity kernel (scan_similarity); model.py: encoders and loss; method.py:
training, the Method and its registration.
"""
