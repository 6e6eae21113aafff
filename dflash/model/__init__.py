"""The model side of DFlash: the target's layers, the drafter, its objective and decoding.

- ``layer_ids``: which target layers feed the drafter (read by :mod:`dflash.features`).
- ``anchors``: random block starts of one document, re-drawn every epoch.
- ``drafter_attention``: the block training rule, as a two-part kernel (CPU) or FlexAttention
  (CUDA).
- ``drafter``: the KV-injection drafter, its config and its Hugging Face style export.
- ``labels``: which block labels of a micro-batch count and how much each weighs, built by
  the loader workers ahead of the step.
- ``objective``: decay-weighted same-position block cross-entropy, LM head chunk by chunk.
- ``generate``: greedy speculative decoding and the plain greedy reference.
- ``document_layout``: where a micro-batch's documents lie, in length classes and query tiles.
- ``target_attention``: the target's attention over packed rows, causal inside each document.
"""
