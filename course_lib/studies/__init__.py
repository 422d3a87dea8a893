"""Analyses that use the trained methods: an index of millions of items (index_scale), the
accuracy-latency frontier (frontier), the Fast & Slow distillation study (fast_slow) and HiVLP's
cascade timings (hivlp_cascade).

Imports core/, data/ and methods/ only.
"""
