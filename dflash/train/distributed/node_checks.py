"""Checks a job spanning several nodes makes before its first step.

Each node trains on its own copy of the inputs with its own params, so one digest on rank 0
vouches for nothing on the others. Its params are compared first, as each rank starts: a worker
with another ``train.lr`` would train the head's drafter with it unrecorded, and one with
another ``train.max_steps`` would leave the others waiting. Then every node hashes its own token
store, plans, tokenizer and target, and a node that differs ends the job, named with the input.
Checkpoints must be readable by every node to be resumed: rank 0 writes a marker with a random
token where they go, and every node must read it back. On one node all checks are skipped (one
copy, one directory).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dflash.errors import UserError
from dflash.model.load import target_digest
from dflash.pipeline.fingerprint import path_digest
from dflash.train.distributed.process_group import Dist, barrier, from_rank_zero
from dflash.train.run_files import TrainFiles


def node_rank() -> int:
    """This process's node (torchrun's group rank; 0 outside torchrun)."""
    return int(os.environ.get("GROUP_RANK", 0))


def many_nodes() -> bool:
    world = int(os.environ.get("WORLD_SIZE", 1))
    return world != int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _first_on_node() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _gather(ctx: Dist, value: object) -> list[tuple[int, object]]:
    """``(node, value)`` of every rank of ``ctx``'s group."""
    values: list = [None] * dist.get_world_size(ctx.group)
    dist.all_gather_object(values, (node_rank(), value), group=ctx.group)
    return values


PER_NODE = (
    "train.checkpoint_dir",
    "train.num_workers",
    "train.prefetch",
    "train.feature_prefetch",
    "train.recompute",
    "train.max_restarts",
    "train.rendezvous_timeout_s",
    "engine.endpoints",
    "engine.backend",
    "engine.timeout_s",
    "engine.max_retries",
    "logging.wandb",
    "logging.project",
)
"""Params a node may set for itself (where it mounts the checkpoints, how it feeds its own ranks,
the engines it asks); every other param of the run must be the head's."""


def shared_params(params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``params`` by dotted key, less :data:`PER_NODE`."""
    flat = {f"{section}.{k}": v for section, values in params.items() for k, v in values.items()}
    return {
        key: value
        for key, value in flat.items()
        if not any(key == p or key.startswith(p + ".") for p in PER_NODE)
    }


_UNSET = object()


def differences(head: dict[str, Any], node: dict[str, Any]) -> list[str]:
    """``key = value (head: value)`` for each param ``node`` holds otherwise than ``head``."""
    return [
        f"{key} = {_shown(node.get(key, _UNSET))} (head: {_shown(head.get(key, _UNSET))})"
        for key in sorted(head.keys() | node.keys())
        if node.get(key, _UNSET) != head.get(key, _UNSET)
    ]


def _shown(value: Any) -> str:
    return "unset" if value is _UNSET else json.dumps(value)


def agree_params(ctx: Dist, params: dict[str, dict[str, Any]]) -> None:
    """Raise on every rank, naming the node and each param with both values, unless every node
    runs the head's params (:func:`shared_params`)."""
    if not (ctx.enabled and many_nodes()):
        return
    gathered = _gather(ctx, shared_params(params) if _first_on_node() else None)
    head = next(p for n, p in gathered if n == 0 and p is not None)
    for node, values in sorted(gathered, key=lambda nv: nv[0]):
        differ = differences(head, values) if values is not None else []
        if differ:
            raise UserError(
                f"node {node} runs other params than the head: {'; '.join(differ)}; every "
                "node must run the head's: rerun it with the command the head printed"
            )


def input_digests(files: TrainFiles) -> dict[str, str]:
    return {
        "token store": path_digest(files.tokenized),
        "plans": path_digest(files.plans),
        "tokenizer": path_digest(files.tokenizer),
        "target": target_digest(files.target),
    }


def agree(ctx: Dist, files: TrainFiles) -> None:
    """Raise on every rank, naming the node and input, unless all nodes hold the head's inputs."""
    if not (ctx.enabled and many_nodes()):
        return
    gathered = _gather(ctx, input_digests(files) if _first_on_node() else None)
    head = next(d for n, d in gathered if n == 0 and d is not None)
    paths = {
        "token store": files.tokenized,
        "plans": files.plans,
        "tokenizer": files.tokenizer,
        "target": files.target,
    }
    for node, digests in gathered:
        for name, value in (digests or {}).items():
            if value != head[name]:
                raise UserError(
                    f"node {node}'s {name} ({paths[name]}) differs from the head's: every node "
                    "must hold the same inputs; copy the head's workspace to it and rerun"
                )


def check_shared(ctx: Dist, root: Path) -> None:
    """Raise on every rank unless every node sees what rank 0 writes under ``root``."""
    if not (ctx.enabled and many_nodes()):
        return
    token = from_rank_zero(ctx, lambda: secrets.token_hex(16))
    marker = root / f".shared-{token}"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    barrier(ctx)
    seen = not _first_on_node() or (marker.exists() and marker.read_text() == token)
    gathered = _gather(ctx, seen)
    if ctx.is_main:
        marker.unlink()
    blind = sorted({node for node, ok in gathered if not ok})
    if blind:
        raise UserError(
            f"train.checkpoint_dir: node(s) {blind} do not see {root.resolve()}, where the head "
            "writes checkpoints, so no node could resume them; set train.checkpoint_dir to a "
            "directory every node mounts at the same path (NFS, Lustre)"
        )
