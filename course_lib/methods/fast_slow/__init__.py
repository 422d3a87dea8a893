"""Fast & Slow (Miech et al. 2021): model.py (the Slow captioning scorer, the Fast dual encoder),
method.py (training, distillation, Methods, the re-ranking cascade)."""
