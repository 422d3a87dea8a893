"""Analyses that use the trained methods (index of millions, frontier, Fast & Slow, HiVLP).
Imports core/, data/ and methods/ only."""
