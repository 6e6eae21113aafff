"""Batching: length statistics, bucket boundaries and per-epoch batch plans.

A plan is a pure function of (lengths, params, seed, epoch), written as one Parquet file per
epoch so the trainer only reads it and every strategy can be measured before any GPU time.
"""
