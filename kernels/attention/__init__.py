"""Attention kernels. Each mechanism is a module; this package only re-exports them."""
from kernels.attention.decode import choose_num_splits, decode_attention, decode_attention_ref
from kernels.attention.reference import attention_ref, causal_mask
from kernels.attention.flash import flash_attention, flash_attention_v1
from kernels.attention.flash_decode import flash_decode, flash_decode_unified_max, flash_decode_ref, combine_ref, split_ref
from kernels.attention.reference import tiled_attention_ref
from kernels.attention.mha import MultiHeadAttention, masked_attention_ref
from kernels.attention.gqa import kv_cache_bytes, mean_pool_kv_heads
