"""Data: ingesting, the tokenizer, regeneration, tokenizing, and the token store."""
