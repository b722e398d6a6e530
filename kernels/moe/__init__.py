"""Mixture of experts: routing (:mod:`.router`), token permutation (:mod:`.permute`), the grouped
GEMM over uneven expert loads (:mod:`.grouped_gemm`), load balancing (:mod:`.balance`), and a small
MoE GPT (:mod:`.model`) trained by :mod:`.train`.

This package re-exports the public names of its kernel modules, except the launcher
``kernels.moe.grouped_gemm.grouped_gemm``, whose name is its module's."""
from kernels.moe.balance import bias_update, max_violation, switch_aux_loss, z_loss
from kernels.moe.grouped_gemm import grouped_gemm_ref, tile_schedule
from kernels.moe.permute import permute_ref, sort_by_expert, unpermute_ref
from kernels.moe.router import (capacity, dropped_fraction, keep_mask, tokens_per_expert, topk_route,
                                topk_route_ref)

__all__ = ["bias_update", "capacity", "dropped_fraction", "grouped_gemm_ref", "keep_mask",
           "max_violation", "permute_ref", "sort_by_expert", "switch_aux_loss", "tile_schedule",
           "tokens_per_expert", "topk_route", "topk_route_ref", "unpermute_ref", "z_loss"]
