"""Distributed parallelism: launching processes, collectives over send/recv, their cost model,
tensor parallelism and ZeRO/FSDP. Everything runs on ``torch.distributed``: gloo across CPU
processes here, NCCL across GPUs with the same code. Importing a module starts nothing."""

import torch.distributed as dist

# The tensor collectives' names: torch 2.13 calls them all_gather_single / reduce_scatter_single and
# deprecates all_gather_into_tensor / reduce_scatter_tensor; torch 2.11 (the lent GPU machines) has
# only the older two. The course calls these wrappers, which look the name up at each call, so a
# recorder that wraps `dist.<ALL_GATHER>` sees every call on either version.
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_single(out, x, group=None):
    """out (N * n,) <- every rank's x (n,), in rank order."""
    return getattr(dist, ALL_GATHER)(out, x, group=group)


def reduce_scatter_single(out, x, group=None):
    """out (n,) <- rank r's slice x[r n:(r+1) n] summed over the ranks."""
    return getattr(dist, REDUCE_SCATTER)(out, x, group=group)
