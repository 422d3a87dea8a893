"""HiVLP (Chen et al.): model.py (early-output layers, the hierarchical retrieval loss), cost.py
(the paper's time model and our multiply-add count), search.py, method.py (training, every level
and the coarse-to-fine cascade as Methods, registrations).
"""
