"""kernels.attention.gqa: KV cache bytes and K/V head conversion of the tiny GPT."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels.attention.gqa import kv_cache_bytes, mean_pool_kv_heads
from kernels.model.surgery import pool_gpt_kv_heads, repeat_gpt_kv_heads
from kernels.model.gpt import GPT, GPTConfig
from kernels.testing import MismatchError, assert_close


def test_kv_cache_bytes_llama3_8b():
    # 32 layers, 8 K/V heads of 128, 8192 positions, fp16: 1 GiB per sequence
    assert kv_cache_bytes(32, 8, 128, 8192) == 2**30
    assert kv_cache_bytes(32, 32, 128, 8192) == 4 * 2**30      # the same model with MHA
    with pytest.raises(ValueError, match="n_kv_head"):
        kv_cache_bytes(32, 0, 128, 10)


def test_mean_pool_is_the_group_mean():
    w = torch.arange(4 * 3 * 5, dtype=torch.float64).reshape(4 * 3, 5)   # 4 heads of D=3, C=5
    pooled = mean_pool_kv_heads(w, 4, 2)
    assert_close(pooled[:3], (w[0:3] + w[3:6]) / 2)
    assert_close(pooled[3:], (w[6:9] + w[9:12]) / 2)
    with pytest.raises(ValueError, match="divide"):
        mean_pool_kv_heads(w, 4, 3)
    with pytest.raises(MismatchError):              # taking the first head is not the mean
        assert_close(w.reshape(2, 2, 3, 5)[:, 0].reshape(6, 5), pooled)


def test_repeat_is_exact_and_pooling_repeats_back_is_exact():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, block_size=16)).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        base = model(x)
        mha = repeat_gpt_kv_heads(model, 4)
        assert mha.config.n_kv_head == 4
        assert_close(mha(x), base, dtype=torch.float32, baseline=base)
        back = pool_gpt_kv_heads(mha, 2)
        assert_close(back(x), base, dtype=torch.float32, baseline=base)
        mqa = pool_gpt_kv_heads(model, 1)
        assert mqa.config.n_kv_head == 1
        assert (mqa(x) - base).abs().max() > 1e-4           # pooling distinct heads changes the function


def test_kv_heads_per_gpu_under_tensor_parallelism():
    from kernels.attention.gqa import kv_heads_per_gpu
    assert kv_heads_per_gpu(8, 1) == (8, 1) and kv_heads_per_gpu(8, 4) == (2, 1) and kv_heads_per_gpu(8, 8) == (1, 1)
    assert kv_heads_per_gpu(8, 16) == (1, 2)          # Llama-3-70B on 16 GPUs: each K/V head on two of them
    assert kv_heads_per_gpu(1, 4) == (1, 4)           # MQA: the one K/V head on every GPU
    with pytest.raises(ValueError, match="multiple"):
        kv_heads_per_gpu(8, 3)
    with pytest.raises(ValueError, match="multiple"):
        kv_heads_per_gpu(4, 6)
