"""A single-stream cross-encoder (UNITER's role): model.py (model, pair scoring), itm.py (ITM
losses), mining.py (hard negatives from a dual encoder), method.py (training, Method)."""
