"""A single-stream cross-encoder (UNITER's role): model.py (the model and pair scoring), itm.py (its ITM
losses), method.py (hard-negative mining, training, the Method and its registration).
"""
