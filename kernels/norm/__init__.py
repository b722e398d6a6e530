"""Normalization layers: BatchNorm (reference), LayerNorm and RMSNorm (references and Triton kernels).

One module per mechanism; this package re-exports their public names.
"""
from kernels.norm.batch_norm import batch_norm, batch_norm_backward_ref, batch_norm_ref
from kernels.norm.layer_norm import layer_norm, layer_norm_backward_ref, layer_norm_ref, merge_moments, moments
from kernels.norm.rms_norm import rms_norm, rms_norm_backward_ref, rms_norm_ref

__all__ = [
    "batch_norm", "batch_norm_ref", "batch_norm_backward_ref",
    "layer_norm", "layer_norm_ref", "layer_norm_backward_ref", "merge_moments", "moments",
    "rms_norm", "rms_norm_ref", "rms_norm_backward_ref",
]
from kernels.norm.add_rms_norm import add_rms_norm, add_rms_norm_ref
