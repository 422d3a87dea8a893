"""One module or small package per paper, each the same shape: model and loss (`model.py`), then its
training, Method and registration (`method.py`; one file where the method is small). The benchmark
discovers methods by importing every module here (`registry`). Shared pieces: `base` (the Method
protocol, the training recipe, cached states), `rerank` (Cascade, two-stage re-ranking), `registry`.

Imports core/ and data/ only.
"""
