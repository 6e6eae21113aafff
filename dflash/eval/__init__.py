"""Evaluation of a trained drafter by real speculative decoding against its target."""
