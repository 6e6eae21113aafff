"""The nodes a train job spans: ``--nnodes N --node-rank R --rdzv-endpoint HOST:PORT``.

Every node runs ``dflash train`` with the same params in its own copy of the workspace; the
head (node 0, the one ``dvc repro`` runs) prints the command each worker runs. The nodes meet
at the endpoint, which the head hosts, within ``train.rendezvous_timeout_s``
(:mod:`dflash.train.distributed.agent`), then through torchrun's static rendezvous: it keeps the
node ranks
given here, so global rank 0, the one writer of exports and metrics, is on the head. (c10d's
rendezvous orders nodes by host name and process id, which can put rank 0 on a worker.)
``train.world_size`` stays the number of drafter ranks the plan is made for; each node runs its
share of them.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass

from dflash.config.schema import TrainConfig
from dflash.errors import UserError


@dataclass(frozen=True)
class Nodes:
    count: int = 1
    rank: int = 0
    endpoint: str | None = None

    @property
    def many(self) -> bool:
        return self.count > 1


NODE_ENV = {
    "nnodes": "DFLASH_NNODES",
    "node_rank": "DFLASH_NODE_RANK",
    "rdzv_endpoint": "DFLASH_RDZV_ENDPOINT",
}
"""Environment variables that stand for the options: ``dvc repro`` runs the stage's fixed
command, so on the head they are how it spans nodes (the node count changes no result)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--nnodes",
        type=int,
        default=env(NODE_ENV["nnodes"], "1"),  # a string: argparse converts and checks it
        help=f"machines the job spans (default: 1, or ${NODE_ENV['nnodes']})",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=env(NODE_ENV["node_rank"], "0"),
        help=f"this machine's place, 0 = the head (default: 0, or ${NODE_ENV['node_rank']})",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        default=env(NODE_ENV["rdzv_endpoint"]),
        metavar="HOST:PORT",
        help="where the nodes meet: the head's address and a free port (with --nnodes > 1; "
        f"or ${NODE_ENV['rdzv_endpoint']})",
    )


def nodes_of(options: argparse.Namespace | None, processes: int, train: TrainConfig) -> Nodes:
    """The nodes ``options`` name, checked against the job's ``processes`` (exit 2 if wrong)."""
    if options is None:
        return Nodes()
    nodes = Nodes(options.nnodes, options.node_rank, options.rdzv_endpoint)
    if nodes.count < 1:
        raise UserError(f"--nnodes must be >= 1, got {nodes.count}")
    if not 0 <= nodes.rank < nodes.count:
        raise UserError(f"--node-rank must be in [0, {nodes.count}), got {nodes.rank}")
    if processes % nodes.count:
        what = "train.world_size" if train.topology == "colocated" else "world_size+target_ranks"
        raise UserError(
            f"--nnodes {nodes.count} does not divide {what} = {processes}: every node runs "
            f"the same number of ranks; choose a divisor, or change {what} and rerun `dflash plan`"
        )
    if nodes.many:
        host, _, port = (nodes.endpoint or "").rpartition(":")
        if not host or not port.isdigit():
            raise UserError(
                f"--nnodes {nodes.count} needs --rdzv-endpoint HOST:PORT (the head's address "
                f"and a free port), got {nodes.endpoint!r}"
            )
    return nodes


def torchrun_args(nodes: Nodes, processes: int) -> list[str]:
    """torchrun's options for this node's share of the job's ``processes`` ranks."""
    per_node = f"--nproc-per-node={processes // nodes.count}"
    if not nodes.many:
        return ["--standalone", per_node]
    return [
        f"--nnodes={nodes.count}",
        f"--node-rank={nodes.rank}",
        "--rdzv-backend=static",
        f"--rdzv-endpoint={nodes.endpoint}",
        per_node,
    ]


def worker_command(nodes: Nodes, options: argparse.Namespace, rank: int) -> str:
    """The command node ``rank`` runs to join the head's job, with the head's params."""
    args = ["dflash", "train", "--params", options.params]
    args += [f"--set={o}" for o in options.overrides]
    args += [f"--nnodes={nodes.count}", f"--node-rank={rank}", f"--rdzv-endpoint={nodes.endpoint}"]
    return shlex.join(args)
