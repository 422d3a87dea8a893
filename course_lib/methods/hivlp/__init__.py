"""HiVLP (Chen et al.): model.py (early-output layers, hierarchical retrieval loss), cost.py (time
model, multiply-add count), search.py, method.py (training, levels and cascade as Methods)."""
