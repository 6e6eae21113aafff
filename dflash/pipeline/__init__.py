"""The pipeline's bookkeeping: declaration, code closure, provenance, freshness, paths, lock."""
