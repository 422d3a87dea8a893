"""SCAN (Lee et al. 2018), stacked cross attention: attention.py (the similarity kernel), model.py
(encoders, loss), method.py (training, the Method, registration)."""
