"""The target as a decoupled drafter rank holds it: its config, embedding and LM head only.

The drafter borrows the target's embedding and LM head; everything else of the target runs on
the target ranks. The model is built on the meta device (no memory), and only the two
borrowed weights are read from its safetensors files, so a drafter rank of a 70B target holds
two vocabulary-sized matrices, not the model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from dflash.model.load import load_target
from dflash.model.target_dir import resolve_target_path, weight_files


def _read(files: dict[str, Path], name: str, dtype: torch.dtype, device) -> torch.Tensor:
    with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)


def load_borrowed(path_or_dir, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The target with real embedding and LM head (tied when the target ties them) and every
    other weight on the meta device; frozen, in eval mode."""
    directory = Path(resolve_target_path(path_or_dir))
    files = weight_files(directory)
    if files is None:
        whole = load_target(directory, device="cpu", dtype=dtype)  # a hub id: read it whole once
        return _keep_borrowed(whole, device)
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    embed_param, head_param = (
        model.get_input_embeddings().weight,
        model.get_output_embeddings().weight,
    )
    names = dict(model.named_parameters(remove_duplicate=False))
    embed_name = next(n for n, p in names.items() if p is embed_param)
    head_name = next(n for n, p in names.items() if p is head_param and n != embed_name)
    embed = nn.Embedding.from_pretrained(_read(files, embed_name, dtype, device), freeze=True)
    tied = head_param is embed_param or head_name not in files
    head = nn.Linear(embed.weight.shape[1], embed.weight.shape[0], bias=False, device="meta")
    head.weight = embed.weight if tied else _frozen(_read(files, head_name, dtype, device))
    model.set_input_embeddings(embed)
    model.set_output_embeddings(head)
    model.requires_grad_(False)
    return model.eval()


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _keep_borrowed(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """``model`` with everything but its embedding and LM head moved to the meta device."""
    borrowed = {model.get_input_embeddings(), model.get_output_embeddings()}
    for module in model.modules():
        if module not in borrowed:
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, _frozen(param.to("meta")))
    for module in borrowed:
        module.to(device)
    return model
