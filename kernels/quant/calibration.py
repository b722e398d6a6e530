"""Calibration data and statistics for post-training quantization of the course's tiny GPT.

Calibration text comes from the *training* split (random windows, fixed seed); the validation loss
is measured on the fixed validation slice of :mod:`kernels.model.train` (the last 10% of the text),
so no statistic ever sees the bytes it is judged on.

The model runs in float64 (its RMSNorm still computes in fp32, as kernels.model.gpt writes it), so
the statistics and the rounding decisions of RTN, AWQ and GPTQ carry about fp32's relative error
from one CPU to another instead of accumulating fp32 matmul differences: a weight flips to the other
code only if it sits within ~1e-7 of a rounding boundary, which moves a validation loss far below
the digits the chapters print.

The statistics a method needs, per nn.Linear of the model (28 of them: 4 blocks x wq, wk, wv, wo,
w_gate, w_up, w_down), all computed from X (T, K), the inputs that layer sees on calibration tokens:

    SmoothQuant:  max_t |X_tk|            (K,)   the per-input-channel activation range
    AWQ:          mean_t |X_tk|           (K,)   the per-input-channel activation magnitude
    GPTQ:         H = (2 / T) X^T X       (K, K) the Hessian of the layer's squared output error
"""
from __future__ import annotations

import copy

import torch

from kernels.model import data
from kernels.model.gpt import GPT, load_pretrained
from kernels.model.train import SEED, evaluate, validation_slice

LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")


def load_model_f64() -> GPT:
    """The committed tiny GPT (models/tiny-gpt), in float64 and eval mode, with no gradients."""
    return load_pretrained().double().requires_grad_(False)


def calibration_tokens(n_windows: int = 16, block_size: int = 128, seed: int = SEED) -> torch.Tensor:
    """``n_windows`` random windows (n_windows, block_size) of the training split: the calibration set."""
    train, _ = data.train_val_split(data.encode(data.load_text()))
    x, _ = data.get_batch(train, n_windows, block_size, torch.Generator().manual_seed(seed))
    return x


def validation_loss(model: GPT, n_windows: int | None = None) -> float:
    """Mean next-byte cross-entropy in nats/byte on the first ``n_windows`` of the validation slice
    (default: all 64 windows, 8192 bytes, the slice models/tiny-gpt/metrics.json reports)."""
    x, y = validation_slice(model.config)
    if n_windows is not None:
        x, y = x[:n_windows], y[:n_windows]
    return evaluate(model, x, y)


def linear_names(model: GPT) -> list[str]:
    """The names of the model's quantizable linears, in forward order (``blocks.0.attn.wq`` ...)."""
    return [f"blocks.{i}.{name}" for i in range(len(model.blocks)) for name in LINEARS]


@torch.no_grad()
def linear_inputs(model: GPT, tokens: torch.Tensor, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The input X (T, K) that each named nn.Linear receives when ``model`` runs on ``tokens`` (B, S)."""
    names = names or linear_names(model)
    captured, hooks = {}, []
    for name in names:
        module = model.get_submodule(name)
        hooks.append(module.register_forward_hook(
            lambda mod, args, out, name=name: captured.__setitem__(name, args[0].reshape(-1, args[0].shape[-1]))))
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return captured


def act_absmax(x: torch.Tensor) -> torch.Tensor:
    """max_t |X_tk|, (K,)."""
    return x.abs().amax(0)


def act_absmean(x: torch.Tensor) -> torch.Tensor:
    """mean_t |X_tk|, (K,)."""
    return x.abs().mean(0)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = (2 / T) X^T X, (K, K): the Hessian of sum_t ||(W - W') x_t||^2 / T with respect to a row of W'."""
    x = x.double()
    return 2.0 / x.shape[0] * x.T @ x


def with_weights(model: GPT, weights: dict[str, torch.Tensor]) -> GPT:
    """A copy of ``model`` whose named linears carry the given weights (the original is untouched)."""
    out = copy.deepcopy(model)
    for name, w in weights.items():
        lin = out.get_submodule(name)
        if w.shape != lin.weight.shape:
            raise ValueError(f"{name}: weight shape {tuple(w.shape)} differs from the layer's {tuple(lin.weight.shape)}")
        lin.weight.data = w.to(lin.weight.dtype).clone()
    return out


def model_bytes(model: GPT, bits_per_weight: float) -> int:
    """Bytes of the model with its linears at ``bits_per_weight`` and everything else (embedding,
    norms) in fp16: the size column of a results table."""
    linear = sum(model.get_submodule(n).weight.numel() for n in linear_names(model))
    other = sum(p.numel() for p in model.parameters()) - linear
    return int(round(linear * bits_per_weight / 8)) + 2 * other
