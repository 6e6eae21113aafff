"""Checkpoints of a run: its parts, its progress, the best weights, and safe reading."""
