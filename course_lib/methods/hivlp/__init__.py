"""HiVLP (Chen et al.): model.py (early-output layers, the hierarchical retrieval loss, the cost model),
method.py (training, every level and the coarse-to-fine cascade as Methods, registrations).
"""
