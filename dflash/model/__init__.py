"""The model side of DFlash: the target's layers, the drafter, its objective and decoding.

- ``layer_ids``: which target layers feed the drafter (read by :mod:`dflash.features`).
- ``anchors``: random block starts of one document, re-drawn every epoch.
- ``drafter_attention``: the block training rule, as a two-part kernel (CPU) or FlexAttention
  (CUDA).
- ``drafter``: the KV-injection drafter, its config and its Hugging Face style export.
- ``objective``: decay-weighted same-position block cross-entropy, LM head chunk by chunk.
- ``generate``: greedy speculative decoding and the plain greedy reference.
- ``target_attention``: the target's attention over packed rows, causal inside each document.
"""
