"""LightningDOT (Sun et al. 2021): model.py (two encoders, the pre-training objectives), method.py
(pre-training and CMR fine-tuning, the Method, re-ranking, registrations).
"""
