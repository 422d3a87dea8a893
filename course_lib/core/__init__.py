"""The kernels every method builds on: settings, special tokens, checkpoints, timing, metrics,
losses, transformer blocks, encoders, FAISS retrieval, the Trainer and its distributed primitives.
The lowest layer: it imports nothing else from course_lib."""
