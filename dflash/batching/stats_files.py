"""The four files of a stats directory (:mod:`dflash.batching.length_stats` writes them; the
plan stage reads the bucket edges)."""

LENGTHS = "lengths.json"
BUCKETS = "buckets.json"
"""Bucket edges by every method, with predicted and simulated padding efficiency."""
HISTOGRAM = "histogram.csv"
PLOT = "lengths.png"
