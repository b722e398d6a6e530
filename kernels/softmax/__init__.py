"""Softmax: the safe and online recurrences in PyTorch and their Triton kernels (:mod:`.online`).

This package re-exports the public names of its modules."""
from kernels.softmax.online import (
    log_softmax_ref, merge_softmax_stats, naive_softmax_ref, online_softmax_ref, softmax, softmax_ref, softmax_stats,
)

__all__ = ["log_softmax_ref", "merge_softmax_stats", "naive_softmax_ref", "online_softmax_ref", "softmax", "softmax_ref",
           "softmax_stats"]
