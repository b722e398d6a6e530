"""A Vision Transformer (Dosovitskiy et al., 2021): an image becomes a sequence of patch tokens.

An image (B, C, H, W) is cut into N = (H/p)(W/p) non-overlapping p x p patches; each patch,
flattened to K = C p p numbers (channel, row, column order), is projected to d_model by one linear
map E (K, d) plus a bias. That projection is a convolution with kernel = stride = p, and also a
plain matmul of the flattened patches with E: the same numbers (:func:`patch_embed_ref` computes it
both ways). A learned class token is prepended (or the tokens are mean-pooled at the end), a learned
position embedding (N [+1], d) is added, and pre-norm encoder blocks follow (no causal mask):

    h = x + MHA(LN_1(x)),   out = h + MLP(LN_2(h)),   MLP(u) = W_2 GELU(W_1 u)

The logits come from LN_f of the class token (or of the mean token) through a linear head.

:func:`patch_embed` is a Triton kernel for the projection that never materialises the patch
matrix: each program gathers a (BLOCK_M patches, BLOCK_K pixels) tile straight from the image
(im2col on the fly) and multiplies it by a (BLOCK_K, BLOCK_N) tile of E.

Shapes: images (B, C, H, W); patches (B, N, K); tokens (B, N, d); logits (B, classes).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import runtime


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 8        # sklearn's digits: 8 x 8 grey images
    channels: int = 1
    patch: int = 2             # 4 x 4 = 16 patches of 2 x 2 pixels
    d_model: int = 64
    n_layer: int = 3
    n_head: int = 4
    d_ff: int = 128
    n_classes: int = 10
    pool: str = "cls"          # "cls": class token; "mean": mean of the patch tokens

    def __post_init__(self):
        if self.image_size % self.patch:
            raise ValueError(f"ViTConfig: image_size={self.image_size} must be a multiple of patch={self.patch}")
        if self.pool not in ("cls", "mean"):
            raise ValueError(f"ViTConfig: pool must be 'cls' or 'mean', got {self.pool!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"ViTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch * self.patch


# ---------------------------------------------------------------- patch embedding, references


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C p p): patches in raster order, each flattened (channel, row, column)."""
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p)            # (B, C, gh, p, gw, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), C * p * p)


def patch_embed_ref(images, weight, bias, p: int, *, as_conv: bool = False) -> torch.Tensor:
    """Tokens (B, N, d): patchify(images) @ weight + bias, or the same as a stride-p convolution.

    weight (K, d) with K = C p p; the convolution uses it as d filters of shape (C, p, p).
    """
    if as_conv:
        C = images.shape[1]
        filters = weight.T.reshape(-1, C, p, p)                  # (d, C, p, p)
        out = F.conv2d(images, filters, bias, stride=p)           # (B, d, H/p, W/p)
        return out.flatten(2).transpose(1, 2)
    return patchify(images, p) @ weight + bias


# ---------------------------------------------------------------- patch embedding, kernel


@triton.jit
def _patch_embed_kernel(
    img_ptr, w_ptr, b_ptr, out_ptr,
    stride_ib, stride_ic, stride_ih, stride_iw,
    M, N_PATCH, GRID_W, K, E,
    P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ADD_BIAS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)             # patch index m = b * N + n
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)             # output feature
    row_ok = rows < M
    col_ok = cols < E
    b = (rows // N_PATCH).to(tl.int64)
    n = rows % N_PATCH
    top = (n // GRID_W) * P                                     # the patch's first pixel row and column
    left = (n % GRID_W) * P
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)                          # k = (c, i, j): channel, row, column in the patch
        c = k // (P * P)
        i = (k // P) % P
        j = k % P
        pix = (img_ptr + b[:, None] * stride_ib + c[None, :] * stride_ic
               + (top[:, None] + i[None, :]) * stride_ih + (left[:, None] + j[None, :]) * stride_iw)
        a = tl.load(pix, mask=row_ok[:, None] & (k < K)[None, :], other=0.0)           # im2col tile, never stored
        w = tl.load(w_ptr + k[:, None] * E + cols[None, :], mask=(k < K)[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)                                                         # tokens += patches @ E
    if ADD_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def patch_embed_launch(M: int, E: int, K: int) -> dict:
    """Tiles: 64 patches x 64 features, K in steps of up to 64 (at least 16, tl.dot's minimum), 8 warps.
    (Compiled for sm_90a without the launch's specialisation, i.e. a runtime ``stride_iw``, the gather's
    index arithmetic took all 255 registers at 4 warps and 177 at 8; at the real launch, where
    ``stride_iw == 1`` is a constexpr, :func:`launch_job` builds with 47 registers at 8 warps.)"""
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=max(16, min(64, triton.next_power_of_2(K))), num_warps=8)


def patch_embed(images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, p: int,
                *, _add_bias: bool = True) -> torch.Tensor:
    """Patch embedding in one kernel: tokens (B, N, d) = patchify(images) @ weight + bias.

    images (B, C, H, W), any strides, fp16, bf16 or fp32 (bf16 is checked on a GPU only: the interpreter
    does not round it, see ``runtime.Runtime.check_dtypes``); weight (C p p, d) contiguous; bias (d,);
    H and W multiples of p. Returns the images' dtype.
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        raise ValueError(f"patch_embed: images must be a 4-D (B, C, H, W) tensor, got "
                         f"{getattr(images, 'shape', type(images).__name__)}")
    B, C, H, W = images.shape
    if not isinstance(p, int) or p < 1 or H % p or W % p:
        raise ValueError(f"patch_embed: patch size p={p!r} must be a positive integer dividing H={H} and W={W}")
    K = C * p * p
    if weight.dim() != 2 or weight.shape[0] != K:
        raise ValueError(f"patch_embed: weight must be (C p p, d) = ({K}, d), got {tuple(weight.shape)}")
    if bias.shape != (weight.shape[1],):
        raise ValueError(f"patch_embed: bias must be (d,) = ({weight.shape[1]},), got {tuple(bias.shape)}")
    if images.dtype not in SUPPORTED_DTYPES or weight.dtype != images.dtype:
        raise TypeError(f"patch_embed: images and weight must share a dtype, float16, bfloat16 or float32; got "
                        f"{images.dtype} and {weight.dtype}")
    for name, t in (("images", images), ("weight", weight), ("bias", bias)):
        if t.device.type != runtime.device().type:
            raise ValueError(f"patch_embed: {name} is on {t.device}, kernels run on {runtime.device()} here")
    weight = weight.contiguous()
    E = weight.shape[1]
    gw = W // p
    M = B * (H // p) * gw
    out = torch.empty((B, M // B, E), dtype=images.dtype, device=images.device)
    grid, args, kwargs = _patch_embed_args(images, weight, bias, out, p, add_bias=_add_bias)
    _patch_embed_kernel[grid](*args, **kwargs)
    return out


def _patch_embed_args(images, weight, bias, out, p: int, *, add_bias: bool = True):
    """(grid, args, kwargs) of one launch of :func:`_patch_embed_kernel`, shared by :func:`patch_embed`
    and :func:`launch_job` so the AOT build is the launch."""
    B, C, H, W = images.shape
    K, E = C * p * p, weight.shape[1]
    gw = W // p
    M = B * (H // p) * gw
    tiles = patch_embed_launch(M, E, K)
    grid = (triton.cdiv(M, tiles["BLOCK_M"]), triton.cdiv(E, tiles["BLOCK_N"]))
    args = (images, weight, bias, out, *images.stride(), M, M // B, gw, K, E)
    return grid, args, dict(P=p, ADD_BIAS=add_bias, **tiles)


def launch_job(batch: int = 32, image: int = 224, p: int = 16, channels: int = 3, dim: int = 768, *,
               dtype=torch.float16, target: str = "sm90"):
    """The job of a GPU launch of :func:`patch_embed` at these sizes, on meta tensors (ViT-B/16 on
    224 x 224 images, batch 32, by default)."""
    from kernels import inspect as ki

    images = torch.empty(batch, channels, image, image, dtype=dtype, device="meta")
    weight = torch.empty(channels * p * p, dim, dtype=dtype, device="meta")
    bias = torch.empty(dim, dtype=dtype, device="meta")
    out = torch.empty(batch, (image // p) ** 2, dim, dtype=dtype, device="meta")
    grid, args, kwargs = _patch_embed_args(images, weight, bias, out, p)
    return ki.launch_job(_patch_embed_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """ViT-B/16's patch embedding, 224 x 224 images, fp16, batch 32 and batch 1."""
    return {f"ViT-B/16 patch embedding, 224x224, fp16, batch {b}": launch_job(batch=b) for b in (32, 1)}


# ---------------------------------------------------------------- the model


class Block(nn.Module):
    """Pre-norm encoder block: h = x + MHA(LN_1(x)); out = h + MLP(LN_2(h)); attention sees every token."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)                       # (B, H, T, D), no mask
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        self.patch_weight = nn.Parameter(torch.randn(cfg.patch_dim, cfg.d_model) / math.sqrt(cfg.patch_dim))  # E (K, d)
        self.patch_bias = nn.Parameter(torch.zeros(cfg.d_model))
        n_tok = cfg.n_patches + (cfg.pool == "cls")
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if cfg.pool == "cls" else None
        self.pos = nn.Parameter(torch.randn(1, n_tok, cfg.d_model) * 0.02)        # learned positions
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)

    def tokens(self, images: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
        """The encoder's input sequence (B, N [+1], d): patch tokens, class token first, plus positions."""
        embed = patch_embed if use_kernel else patch_embed_ref
        x = embed(images, self.patch_weight, self.patch_bias, self.config.patch)   # (B, N, d)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos

    def forward(self, images: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
        x = self.tokens(images, use_kernel)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        pooled = x[:, 0] if self.cls is not None else x.mean(1)
        return self.head(pooled)                                          # (B, classes)


def resample_positions(pos: torch.Tensor, grid: int, new_grid: int, *, mode: str = "bicubic",
                       has_cls: bool = True) -> torch.Tensor:
    """Learned positions (1, [1 +] grid^2, d) of a grid x grid patch layout -> (1, [1 +] new_grid^2, d),
    the patch part resized as a (d, grid, grid) image by ``mode`` interpolation (the ViT paper's 2D
    interpolation for fine-tuning at a higher resolution), the class token's position kept."""
    if mode not in ("bicubic", "bilinear", "nearest"):
        raise ValueError(f"resample_positions: mode must be bicubic, bilinear or nearest, got {mode!r}")
    cls, patches = (pos[:, :1], pos[:, 1:]) if has_cls else (pos[:, :0], pos)
    if patches.shape[1] != grid * grid:
        raise ValueError(f"resample_positions: pos holds {patches.shape[1]} patch positions, not grid^2 = {grid * grid}")
    img = patches.reshape(1, grid, grid, -1).permute(0, 3, 1, 2)                 # (1, d, grid, grid)
    kw = {} if mode == "nearest" else {"align_corners": False}
    new = F.interpolate(img, size=(new_grid, new_grid), mode=mode, **kw)          # (1, d, new, new)
    return torch.cat([cls, new.permute(0, 2, 3, 1).reshape(1, new_grid * new_grid, -1)], dim=1)


# ---------------------------------------------------------------- data, training, checkpoint

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-vit"
TRAIN = dict(steps=600, batch_size=64, lr=3e-3, weight_decay=0.05, seed=0)


def digits(split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8 x 8 digits (1797 images, pixel values 0..16) as (B, 1, 8, 8) in [0, 1],
    a fixed shuffled split: the first 1397 train, the last 400 test."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    idx = perm[:1397] if split == "train" else perm[1397:]
    return x[idx], y[idx]


def train(cfg: ViTConfig = ViTConfig(), *, steps: int = TRAIN["steps"], progress: bool = False,
          n_train: int | None = None, seed: int = TRAIN["seed"]):
    """AdamW with a one-cycle schedule over ``steps`` on random batches of the training split (its first
    ``n_train`` images of a ``seed`` permutation when given, for the data-size sweep); returns (model, losses)."""
    torch.manual_seed(seed)
    model = ViT(cfg)
    x, y = train_subset(n_train, seed) if n_train is not None else digits("train")
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=TRAIN["lr"], total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="tiny ViT")
    losses = []
    model.train()
    for _ in it:
        idx = torch.randint(0, len(y), (TRAIN["batch_size"],), generator=gen)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return model.eval(), losses


def train_subset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` images of a ``seed`` permutation of the training split (the data-size sweep's sets)."""
    x, y = digits("train")
    if not isinstance(n, int) or not 10 <= n <= len(y):
        raise ValueError(f"train_subset: n must be an int in [10, {len(y)}], got {n!r}")
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(1000 + seed))[:n]
    return x[idx], y[idx]


SWEEP = dict(sizes=[50, 100, 200, 400, 1397], seeds=[0, 1, 2], steps=300)
SWEEP_FILE = MODEL_DIR / "data_sweep.json"


def data_sweep() -> dict:
    """Test accuracy of the tiny ViT and of multinomial logistic regression on the pixels, trained on the
    same subsets (``SWEEP`` sizes x seeds, the ViT for ``SWEEP['steps']`` steps at every size)."""
    from sklearn.linear_model import LogisticRegression
    x_test, y_test = digits("test")
    flat = lambda images: images.reshape(len(images), -1).double().numpy()
    out = {"vit": {}, "logistic": {}}
    for n in SWEEP["sizes"]:
        for seed in SWEEP["seeds"]:
            model, _ = train(ViTConfig(), steps=SWEEP["steps"], n_train=n, seed=seed)
            with torch.no_grad():
                out["vit"].setdefault(str(n), []).append(float((model(x_test).argmax(-1) == y_test).float().mean()))
            xs, ys = train_subset(n, seed)
            lin = LogisticRegression(C=1.0, tol=1e-10, max_iter=10_000).fit(flat(xs), ys.numpy())
            out["logistic"].setdefault(str(n), []).append(float((lin.predict(flat(x_test)) == y_test.numpy()).mean()))
    return out


@torch.no_grad()
def accuracy(model: ViT, split: str = "test") -> float:
    x, y = digits(split)
    return float((model(x).argmax(-1) == y).float().mean())


def load_pretrained(directory: Path | str = MODEL_DIR) -> ViT:
    directory = Path(directory)
    cfg = ViTConfig(**json.loads((directory / "config.json").read_text()))
    model = ViT(cfg)
    model.load_state_dict(torch.load(directory / "model.pt", map_location="cpu", weights_only=True))
    return model.eval()


def main() -> int:
    """python -m kernels.model.vit: train the tiny ViT on the digits, write models/tiny-vit/."""
    import time
    torch.set_num_threads(1)
    start = time.time()
    cfg = ViTConfig()
    model, losses = train(cfg, progress=True)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), MODEL_DIR / "model.pt")
    (MODEL_DIR / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    mean_model, _ = train(ViTConfig(pool="mean"), progress=True)          # the pooling comparison; not saved
    metrics = {"test_accuracy": accuracy(model, "test"), "train_accuracy": accuracy(model, "train"),
               "mean_pool_test_accuracy": accuracy(mean_model, "test"),
               "final_loss_mean_last50": sum(losses[-50:]) / 50, "train": TRAIN, "seconds": round(time.time() - start, 1),
               "parameters": sum(p.numel() for p in model.parameters()), "threads": 1, "torch": torch.__version__,
               "data": "sklearn.datasets.load_digits, first 1397 of a seed-0 permutation train, last 400 test",
               "command": "python -m kernels.model.vit"}
    (MODEL_DIR / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(metrics)
    return 0


def sweep_main() -> int:
    """python -m kernels.model.vit sweep: the data-size sweep, written to models/tiny-vit/data_sweep.json."""
    import time
    torch.set_num_threads(1)
    start = time.time()
    result = data_sweep()
    result.update(sweep=SWEEP, seconds=round(time.time() - start, 1), threads=1, torch=torch.__version__,
                  command="python -m kernels.model.vit sweep")
    SWEEP_FILE.write_text(json.dumps(result, indent=2) + "\n")
    print(result)
    return 0


if __name__ == "__main__":
    import sys
    raise SystemExit(sweep_main() if sys.argv[1:] == ["sweep"] else main())
