"""U-BERT (Yu et al.): model.py (intra- and inter-modal decomposition, the light cross encoder),
method.py (two-step training, the Method and cascades, registrations).
"""
