"""A single-stream cross-encoder (UNITER's role): model.py (the model and pair scoring), itm.py
(its ITM losses), mining.py (hard negatives from a dual encoder), method.py (training, the Method
and its registration).
"""
