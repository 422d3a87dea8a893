"""Data: the synthetic benchmark, the Karpathy-split reader, the tokenizer and torch datasets."""
