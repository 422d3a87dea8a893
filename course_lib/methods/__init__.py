"""One module or package per paper: model and loss (`model.py`), training, Method and registration
(`method.py`). Shared: `base` (Method protocol, training recipe), `rerank` (cascades), `registry`.
Imports core/ and data/ only."""
