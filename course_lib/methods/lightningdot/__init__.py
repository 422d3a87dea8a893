"""LightningDOT (Sun et al. 2021): model.py (two encoders, pre-training objectives), method.py
(pre-training, CMR fine-tuning, the Method, re-ranking)."""
