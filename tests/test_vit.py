"""kernels.model.vit: patch embedding (convolution == matmul == the im2col-on-the-fly Triton kernel),
the ViT's two poolings, and the committed tiny ViT's accuracy on scikit-learn's digits."""
import kernels  # noqa: F401  (before triton)

import json

import pytest
import torch

from kernels import inspect as ki
from kernels import runtime
from kernels.model import vit
from kernels.testing import MismatchError, assert_close, nan_canary

DTYPES = runtime.runtime().check_dtypes


def _case(B, C, H, W, p, E, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(B, C, H, W, generator=g, dtype=torch.float64)
    w = torch.randn(C * p * p, E, generator=g, dtype=torch.float64) / (C * p * p) ** 0.5
    b = torch.randn(E, generator=g, dtype=torch.float64)
    return img.to(dtype), w.to(dtype), b.to(dtype)


def test_patchify_order():
    img = torch.arange(2 * 4 * 6, dtype=torch.float32).view(1, 2, 4, 6)
    patches = vit.patchify(img, 2)                       # 2 x 3 grid of 2 x 2 patches
    assert patches.shape == (1, 6, 8)
    assert patches[0, 4].tolist() == [14, 15, 20, 21, 38, 39, 44, 45]   # row 1, column 1; channel 0 then 1


def test_convolution_equals_matmul():
    img, w, b = _case(2, 3, 12, 20, 4, 40, torch.float64)
    assert_close(vit.patch_embed_ref(img, w, b, 4, as_conv=True), vit.patch_embed_ref(img, w, b, 4))


CASES = [
    # B, C, H,  W,  p, E
    (3, 3, 12, 20, 4, 40),      # 45 patches, K = 48 and E = 40 below one tile
    (2, 1, 8, 8, 2, 64),        # the tiny ViT's shape
    (5, 3, 32, 24, 4, 100),     # 240 patches: 4 row tiles, 2 column tiles with a tail
    (1, 2, 6, 6, 3, 17),        # p = 3 (not a power of two), K = 18
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,C,H,W,p,E", CASES)
def test_kernel_matches_reference(B, C, H, W, p, E, dtype):
    img, w, b = _case(B, C, H, W, p, E, dtype)
    got = vit.patch_embed(nan_canary(img), nan_canary(w), nan_canary(b), p)
    want = vit.patch_embed_ref(img.double(), w.double(), b.double(), p)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, dtype=dtype, baseline=vit.patch_embed_ref(img, w, b, p))


def test_kernel_reads_strided_images():
    img, w, b = _case(2, 3, 8, 12, 4, 24)
    chlast = nan_canary(img.permute(0, 2, 3, 1).contiguous()).permute(0, 3, 1, 2)   # channels-last view
    assert not chlast.is_contiguous()
    assert_close(vit.patch_embed(chlast, w, b, 4), vit.patch_embed_ref(img.double(), w.double(), b.double(), 4),
                 dtype=torch.float32, baseline=vit.patch_embed_ref(img, w, b, 4))


def test_kernel_without_the_bias_is_caught():
    img, w, b = _case(2, 1, 8, 8, 2, 64)
    with pytest.raises(MismatchError):
        assert_close(vit.patch_embed(img, w, b, 2, _add_bias=False), vit.patch_embed_ref(img, w, b, 2))


def test_bad_inputs_raise_clear_errors():
    img, w, b = _case(1, 3, 8, 8, 4, 16)
    with pytest.raises(ValueError, match="dividing H=8"):
        vit.patch_embed(img, w, b, 3)
    with pytest.raises(ValueError, match=r"\(C p p, d\) = \(48, d\)"):
        vit.patch_embed(img, w[:40], b, 4)
    with pytest.raises(ValueError, match="bias must be"):
        vit.patch_embed(img, w, b[:3], 4)
    with pytest.raises(TypeError, match="share a dtype"):
        vit.patch_embed(img, w.half(), b, 4)
    with pytest.raises(ValueError, match="4-D"):
        vit.patch_embed(img[0], w, b, 4)
    with pytest.raises(ValueError, match="pool"):
        vit.ViTConfig(pool="max")


def test_sm90_build_at_vit_b16_does_not_spill():
    """ViT-B/16: 3 x 16 x 16 = 768 pixels per patch to 768 features, fp16, the job of the real launch
    (224 x 224 images, batch 32); every compile_jobs() entry is that launch's job."""
    jobs = vit.compile_jobs()
    assert all(j.constexprs["P"] == 16 and j.grid[1] == 12 for j in jobs.values())
    job = vit.launch_job()
    assert job.grid == (98, 12) and job.constexprs["stride_iw"] == 1
    bf16 = vit.launch_job(dtype=torch.bfloat16)          # how ViTs run; its arithmetic is checked on a GPU
    builds = ki.compile_triton_many([job, bf16], archs=("sm90",))
    for build in (b["sm90"] for b in builds):
        assert build.spills == 0 and build.metadata["stack_bytes"] == 0 and build.metadata["registers"] < 255
        assert build.families("sass")["HGMMA"] > 0 or build.families("sass")["HMMA"] > 0
    assert "f32.bf16.bf16" in builds[1]["sm90"].ptx and ".bf16" not in builds[0]["sm90"].ptx   # a bf16 wgmma, no cast to fp16


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_model_forward_and_kernel_path(pool):
    torch.manual_seed(0)
    model = vit.ViT(vit.ViTConfig(pool=pool)).eval()
    x, _ = vit.digits("test")
    with torch.no_grad():
        ref = model(x[:5])
        assert ref.shape == (5, 10)
        assert float((model(x[:5], use_kernel=True) - ref).abs().max()) < 1e-3     # fp32 GEMM orders differ
        n_tok = model.tokens(x[:5]).shape[1]
    assert n_tok == 16 + (pool == "cls")


def test_a_few_training_steps_lower_the_loss():
    _, losses = vit.train(steps=8)
    assert losses[-1] < losses[0]


def test_committed_checkpoint_reproduces_its_accuracy():
    metrics = json.loads((vit.MODEL_DIR / "metrics.json").read_text())
    assert (vit.MODEL_DIR / "model.pt").stat().st_size < 5 * 2**20
    model = vit.load_pretrained()
    acc = vit.accuracy(model, "test")
    assert abs(acc - metrics["test_accuracy"]) <= 1 / 400 + 1e-9 and acc > 0.9   # one near-tie may flip on another CPU


def test_committed_data_sweep_covers_its_grid_and_the_subsets_are_checked():
    sweep = json.loads(vit.SWEEP_FILE.read_text())
    assert sweep["sweep"] == vit.SWEEP
    for key in ("vit", "logistic"):
        assert sorted(map(int, sweep[key])) == vit.SWEEP["sizes"]
        assert all(len(v) == len(vit.SWEEP["seeds"]) and all(0 <= a <= 1 for a in v) for v in sweep[key].values())
    xs, ys = vit.train_subset(50, 1)
    assert xs.shape == (50, 1, 8, 8) and not torch.equal(vit.train_subset(50, 2)[1], ys)
    for bad in (5, 5000, 50.0):
        with pytest.raises(ValueError, match="n must be"):
            vit.train_subset(bad, 0)


def test_resample_positions_keeps_the_grid_and_the_class_token():
    g = torch.Generator().manual_seed(0)
    pos = torch.randn(1, 17, 8, generator=g)
    for mode in ("bicubic", "bilinear", "nearest"):
        assert torch.allclose(vit.resample_positions(pos, 4, 4, mode=mode), pos, atol=1e-6)
        out = vit.resample_positions(pos, 4, 6, mode=mode)
        assert out.shape == (1, 37, 8) and torch.equal(out[:, 0], pos[:, 0])
    up = vit.resample_positions(pos, 4, 8, mode="nearest")[0, 1:].reshape(8, 8, 8)
    assert torch.equal(up[::2, ::2], pos[0, 1:].reshape(4, 4, 8))      # nearest doubling repeats each position
    with pytest.raises(ValueError, match="mode"):
        vit.resample_positions(pos, 4, 6, mode="area")
    with pytest.raises(ValueError, match="grid"):
        vit.resample_positions(pos, 3, 6)
