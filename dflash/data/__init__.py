"""Data stages: ingest, tokenizer, tokenize, and the token store they produce."""
