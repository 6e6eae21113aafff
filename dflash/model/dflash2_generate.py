"""Greedy speculative decoding with a DFlash 2 drafter: the block read off by the selector.

The drafter fills ``[last, MASK x (bs-1)]`` in one pass as DFlash does; the drafted tokens are
then the selector's greedy walk from the anchor (``last``), each slot's candidate chosen given
the one drafted before it, which is what vLLM, SGLang and z-lab's ``dflash_generate`` propose.
Verification is :func:`~dflash.model.generate.speculative_generate`'s, so the output is the
target's greedy output whatever the drafter proposes.
"""

from __future__ import annotations

import torch

from dflash.model.dflash2_drafter import DFlash2Drafter
from dflash.model.drafter import drafter_autocast
from dflash.model.generate import DrafterProposer


class SelectorProposer(DrafterProposer):
    """:class:`~dflash.model.generate.DrafterProposer` whose drafts are the selector's walk,
    not each slot's argmax."""

    drafter: DFlash2Drafter

    def propose(self, history: list[int], position: int) -> list[int]:
        """Always a whole block, as in training, even where fewer drafts can be verified."""
        device, c = self.features.device, self.drafter.config
        block = torch.full((1, c.block_size), c.mask_token_id, device=device)
        block[0, 0] = history[-1]
        positions = torch.arange(position, position + c.block_size, device=device)[None]
        with drafter_autocast(device):
            hidden = self.drafter(
                block, positions, self.features, self.context_positions, cache=self.cache
            )
            drafts = self.drafter.walk(hidden, block[:, 0]).tokens[0]
        self.features = self.context_positions = None  # in the cache now
        return drafts.tolist()
