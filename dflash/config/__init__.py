"""The typed params: their schema, building blocks, loading and the generated page."""
