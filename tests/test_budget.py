"""kernels.model.budget: parameter counts, sliding-window caches, the memory plan and one layer's work."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kernels.attention.gqa import kv_cache_bytes
from kernels.gpu import hardware
from kernels.model import budget as sv
from kernels.model.gpt import GPT, GPTConfig, KVCache, count_parameters


def test_parameter_counts_match_the_released_models():
    # the totals the model cards print: 8.03B, 70.6B, 7.24B
    assert sv.parameter_count(sv.LLAMA3_8B)["total"] == 8_030_261_248
    assert sv.parameter_count(sv.LLAMA3_70B)["total"] == 70_553_706_496
    assert sv.parameter_count(sv.MISTRAL_7B)["total"] == 7_241_732_096
    cfg = GPTConfig()
    assert sv.parameter_count(sv.of_gpt(cfg))["total"] == count_parameters(cfg)["total"]


def test_sliding_window_caps_the_cache():
    m = sv.MISTRAL_7B
    assert sv.cached_positions(m, 100) == 100
    assert sv.cached_positions(m, 8192) == 4096 == sv.cached_positions(m, 32768)
    assert sv.kv_bytes(m, 8192) == sv.kv_bytes(sv.LLAMA3_8B, 8192) // 2 == 2**29
    assert sv.kv_bytes(sv.LLAMA3_8B, 8192, 3, "fp8") == kv_cache_bytes(32, 8, 128, 8192, 3, 1)
    with pytest.raises(ValueError, match="context"):
        sv.cached_positions(sv.LLAMA3_8B, 8193)        # past max_position_embeddings
    with pytest.raises(ValueError, match="kv_dtype"):
        sv.kv_bytes(m, 10, kv_dtype="int4")


def test_plan_is_the_largest_batch_that_fits():
    for m, g, wd, kv, ctx in [(sv.LLAMA3_8B, "H100", "bf16", "bf16", 8192), (sv.LLAMA3_8B, "H200", "bf16", "fp8", 3000),
                              (sv.LLAMA3_70B, "H200", "fp8", "bf16", 8192), (sv.MISTRAL_7B, "H100", "bf16", "bf16", 32768)]:
        p = sv.plan(m, g, ctx, weight_dtype=wd, kv_dtype=kv)
        used = lambda b: p.weights + p.workspace + b * sv.kv_bytes(m, ctx, 1, kv)  # noqa: E731
        assert p.max_batch >= 1
        assert used(p.max_batch) <= p.usable < used(p.max_batch + 1)   # one more sequence does not fit
        assert p.usable == int(0.9 * hardware.gpu(g).hbm_gib * 2**30)
    # by hand: Llama 3 8B on an H100 at 8192 tokens, bf16: (72 GiB - 16.06 GB - workspace) / 1 GiB
    p = sv.plan(sv.LLAMA3_8B, "H100", 8192)
    assert (p.weights, p.kv_per_sequence, p.max_batch) == (2 * 8_030_261_248, 2**30, 55)
    # weights that do not fit give 0, not a negative batch
    assert sv.plan(sv.LLAMA3_70B, "H200", 1024).max_batch == 0
    with pytest.raises(ValueError, match="utilization"):
        sv.plan(sv.LLAMA3_8B, "H100", 10, utilization=1.5)
    with pytest.raises(ValueError, match="weight_dtype"):
        sv.plan(sv.LLAMA3_8B, "H100", 10, weight_dtype="fp4x")


def test_decode_reads_one_embedding_row_per_sequence():
    m = sv.LLAMA3_8B
    p = sv.parameter_count(m)
    b = sv.decode_step_bytes(m, batch=4, context=8192)
    assert b["weights"] == 2 * (p["total"] - p["embedding"])          # the LM head is read, the embedding is not
    assert b["embedding_rows"] == 4 * 4096 * 2
    assert b["kv_cache"] == 4 * 2**30
    tiny = sv.of_gpt(GPTConfig())                                       # tied: the head reads the whole table
    assert sv.decode_step_bytes(tiny, 1, 10, weight_dtype="fp32")["weights"] == 4 * sv.parameter_count(tiny)["total"]


def _block_flops(cfg, T, past):
    """FlopCounterMode's count of one Block of a random tiny GPT on T new tokens after `past` cached."""
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    cache = KVCache.empty(cfg, 1)
    with torch.no_grad():
        if past:
            model(torch.randint(0, cfg.vocab_size, (1, past)), cache=cache)
        x = torch.randn(1, T, cfg.d_model)
        pos = cache.seqlens.long()[:, None] + torch.arange(T)
        with FlopCounterMode(display=False) as fc:
            model.blocks[0](x, pos, cache=cache, layer=0)
    return fc.get_total_flops()


def test_layer_flops_match_the_flop_counter():
    cfg = GPTConfig(n_layer=1, n_head=4, n_kv_head=2, d_model=64, d_ff=96, block_size=64)
    m = sv.of_gpt(cfg)
    work = lambda T, past: sum(sv.layer_work(m, T, past, dtype="fp32")[k]["flops"] for k in ("attention", "mlp"))  # noqa: E731
    assert _block_flops(cfg, 1, 20) == work(1, 20)                      # decode: one query over 21 keys
    # prefill: the dense implementation also scores the masked upper triangle, T (T - 1) / 2 pairs
    T, Hq, D = 30, cfg.n_head, cfg.head_dim
    assert _block_flops(cfg, T, 0) == work(T, 0) + 4 * Hq * D * T * (T - 1) // 2
    with pytest.raises(AssertionError):                                 # the dense count is not the causal one
        assert _block_flops(cfg, T, 0) == work(T, 0)


def test_decode_is_memory_bound_and_prefill_compute_bound_on_h100():
    ridge = hardware.ridge_point("H100", "bf16")
    prefill = sv.layer_work(sv.LLAMA3_8B, 2048, 0)
    decode = sv.layer_work(sv.LLAMA3_8B, 1, 8191)
    assert prefill["mlp"]["intensity"] > ridge and prefill["attention"]["intensity"] > ridge
    assert decode["mlp"]["intensity"] < 2 and decode["attention"]["intensity"] < 4 < ridge
    # batching decode helps the MLP (weights shared) but not attention's core (each sequence its own cache)
    batched = sv.layer_work(sv.LLAMA3_8B, 1, 8191, batch=64)
    assert batched["mlp"]["intensity"] > 60 and batched["attention"]["intensity"] < 8
    with pytest.raises(ValueError, match="new_tokens"):
        sv.layer_work(sv.LLAMA3_8B, 0, 0)
