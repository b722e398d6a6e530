"""kernels.position.scaling (through rope_frequencies): every rule against transformers'
ROPE_INIT_FUNCTIONS, the defining properties of each, the numbers of the configs that use them, and
the tiny GPT's perplexity past its training length (kernels.position.tiny_gpt)."""
import kernels  # noqa: F401  (before triton)

import math

import pytest
import torch

from kernels.position import rope_frequencies
from kernels.position.scaling import yarn_attention_factor, yarn_correction_range, yarn_ramp
from kernels.testing import MismatchError, assert_close

hf = pytest.importorskip("transformers.modeling_rope_utils")
LlamaConfig = pytest.importorskip("transformers").LlamaConfig


def _hf(rope_parameters, dim, max_pos, seq_len=None):
    cfg = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, max_position_embeddings=max_pos,
                      rope_parameters=rope_parameters)
    fn = hf.ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]]
    return fn(cfg, "cpu", seq_len=seq_len) if seq_len else fn(cfg, "cpu")


@pytest.mark.parametrize("dim,base", [(32, 10000.0), (128, 500000.0)])
def test_linear_matches_transformers(dim, base):
    inv, att = rope_frequencies(dim, base, {"type": "linear", "factor": 4.0})
    want, want_att = _hf(dict(rope_type="linear", rope_theta=base, factor=4.0), dim, 512)
    assert_close(inv.float(), want)
    assert att == want_att == 1.0


@pytest.mark.parametrize("seq_len", [128, 300, 512])
def test_dynamic_matches_transformers(seq_len):
    sc = {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 128}
    inv, _ = rope_frequencies(32, 10000.0, sc, seq_len=seq_len)
    want, _ = _hf(dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0), 32, 128, seq_len=seq_len)
    assert_close(inv.float(), want)


def test_dynamic_is_plain_rope_within_the_training_length():
    sc = {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 128}
    assert_close(rope_frequencies(32, 10000.0, sc, seq_len=100)[0], rope_frequencies(32, 10000.0)[0])


@pytest.mark.parametrize("dim,base,orig,factor", [(32, 10000.0, 128, 4.0), (128, 10000.0, 4096, 16.0),
                                                  (128, 10000.0, 4096, 32.0)])
def test_yarn_matches_transformers(dim, base, orig, factor):
    sc = {"type": "yarn", "factor": factor, "original_max_position_embeddings": orig}
    inv, att = rope_frequencies(dim, base, sc)
    want, want_att = _hf(dict(rope_type="yarn", rope_theta=base, factor=factor, original_max_position_embeddings=orig),
                         dim, int(orig * factor))
    assert_close(inv.float(), want)
    assert abs(att - want_att) < 1e-12 and abs(att - (0.1 * math.log(factor) + 1)) < 1e-12


def test_llama31_config_matches_transformers_and_its_bands():
    """Llama 3.1: head dim 128, theta 500000, factor 8, low/high frequency factors 1 and 4, original 8192."""
    sc = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    inv, att = rope_frequencies(128, 500000.0, sc)
    want, _ = _hf(dict(rope_type="llama3", rope_theta=500000.0, **{k: v for k, v in sc.items() if k != "type"}),
                  128, 131072)
    assert_close(inv.float(), want)
    assert att == 1.0
    plain = rope_frequencies(128, 500000.0)[0]
    wavelen = 2 * math.pi / plain
    kept, scaled = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert_close(inv[kept], plain[kept])
    assert_close(inv[scaled], plain[scaled] / 8)
    assert (int(kept.sum()), int(scaled.sum()), int((~kept & ~scaled).sum())) == (29, 29, 6)


def test_ntk_aware_properties():
    """bloc97's base * alpha^(d/(d-2)): the fastest pair unchanged, the slowest divided by exactly alpha,
    and the same frequencies as the dynamic rule at the length where its alpha equals this one."""
    inv, _ = rope_frequencies(32, 10000.0, {"type": "ntk", "factor": 4.0})
    plain = rope_frequencies(32, 10000.0)[0]
    assert abs(inv[0] - plain[0]) < 1e-15 and abs(inv[-1] - plain[-1] / 4) < 1e-15
    assert bool((inv <= plain).all())
    # dynamic: alpha = s n / L - (s - 1); with s = 4, L = 128: alpha = 4 at n = 224
    dyn, _ = rope_frequencies(32, 10000.0, {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 128},
                              seq_len=224)
    assert_close(inv, dyn)


def test_yarn_ramp_and_range_for_llama2():
    """Llama 2 (D = 128, base 10000, L = 4096), beta_fast 32, beta_slow 1: the ramp runs from pair 20 to 46."""
    assert yarn_correction_range(128, 10000.0, 4096) == (20, 46)
    ramp = yarn_ramp(128, 10000.0, 4096)
    assert float(ramp[:21].max()) == 0.0 and float(ramp[46:].min()) == 1.0
    assert bool((ramp[1:] >= ramp[:-1]).all())
    assert yarn_attention_factor(1.0) == 1.0


def test_a_wrong_rule_is_caught():
    """YaRN without the ramp (every pair interpolated) is position interpolation, not YaRN."""
    yarn, _ = rope_frequencies(32, 10000.0, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    linear, _ = rope_frequencies(32, 10000.0, {"type": "linear", "factor": 4.0})
    with pytest.raises(MismatchError):
        assert_close(linear, yarn)


def test_bad_scaling_raises_clear_errors():
    with pytest.raises(ValueError, match="'type' in"):
        rope_frequencies(32, 10000.0, {"type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="needs 'original_max_position_embeddings'"):
        rope_frequencies(32, 10000.0, {"type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="factor must be"):
        rope_frequencies(32, 10000.0, {"type": "linear", "factor": 0.5})
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        rope_frequencies(32, 10000.0, {"type": "llama3", "factor": 2.0, "original_max_position_embeddings": 64})


# ----------------------------------------------------------------------------------------------
# The tiny GPT past its training length (kernels.position.yarn_finetune, committed results)


def test_yarn_finetune_results_reproduce_and_hold():
    import json

    from kernels.position import yarn_finetune as yf
    res = json.loads(yf.OUT.read_text())
    before = yf.band_losses(yf.load_pretrained())
    assert all(abs(a - b) < 1e-3 for a, b in zip(before, res["before"]))
    assert all(b - a > 0.15 for a, b in zip(res["after"], res["before"]))
    assert abs(res["after"][3] - res["sliding_window_448_510"]) < 0.01


def test_yarn_finetune_runs_a_few_steps():
    from kernels.position import yarn_finetune as yf
    _, losses = yf.finetune(steps=2)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
