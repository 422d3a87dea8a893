"""U-BERT (Yu et al.): model.py (intra-/inter-modal decomposition, light cross encoder), method.py
(two-step training, the Method, cascades)."""
