"""Fast & Slow (Miech et al. 2021): model.py (the Slow captioning scorer and the Fast dual encoder),
method.py (training, distillation, the Methods and the re-ranking cascade, registrations).
"""
