"""Attention kernels. Each mechanism is a module; this package only re-exports them."""
from kernels.attention.decode import decode_attention, decode_attention_ref
