"""SmoothQuant: move the activation outliers of a linear layer into its weights, then run it in W8A8.

Y = X W^T is unchanged by any per-input-channel scale s (K,):

    Y = (X diag(s)^-1) (W diag(s))^T                                      (1)

Activations of trained transformers have a few input channels k whose magnitudes are far larger
than the rest (on every token), while the weights are flat. Per-token int8 quantization of X spends
its 255 codes on the outlier channels' range and rounds the others to a few codes. Dividing X by
s_k flattens the channels; multiplying W's columns by s_k moves the range into the weights, which
per-output-channel int8 handles well. SmoothQuant (Xiao et al., 2023, eq. 4) balances the two with
one exponent alpha:

    s_k = max_t |X_tk|^alpha / max_n |W_nk|^(1 - alpha)                   (2)

alpha = 0 leaves X alone, alpha = 1 moves all of its range into W. diag(s)^-1 costs nothing at run
time: it is folded into the operation that produces X (the RMSNorm gain for W_q/W_k/W_v and
W_gate/W_up; the rows of W_up for W_down, since silu(g) * (u / s) = (silu(g) * u) / s).

W8A8 then runs as :func:`kernels.quant.w8a8.w8a8_matmul`: X quantized per token, W per output
channel, both scales applied after the int32 sum. :func:`fake_w8a8` computes the same values at the
other granularities of the paper (per-tensor weights; per-tensor activation scales, dynamic or
static, i.e. calibrated offline), to compare them on one layer.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from kernels.model.gpt import GPT
from kernels.quant.calibration import act_absmax, linear_inputs
from kernels.quant.intq import quantize_per_channel, quantize_per_token

# (operation that produces X and absorbs 1 / s, the linears that read X): the smoothed pairs of one block
SMOOTH_GROUPS = (
    ("norm1", ("attn.wq", "attn.wk", "attn.wv")),
    ("norm2", ("mlp.w_gate", "mlp.w_up")),
    ("mlp.w_up", ("mlp.w_down",)),
)


def smooth_scales(x_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """Equation (2): s (K,) from max_t |X_tk| and the weights (N_i, K) that read X (max taken over all of them)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    w_absmax = torch.cat([w.abs() for w in weights], 0).amax(0).clamp(min=1e-5)   # max_n |W_nk|
    return (x_absmax.clamp(min=1e-5) ** alpha / w_absmax ** (1 - alpha)).clamp(min=1e-5)


def w8a8_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """X W^T through int8: X per token, W per output channel, the product of the dequantized codes (float64)."""
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_per_channel(w)
    return (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).T


ACT_GRANULARITIES = ("token", "tensor", "static")


def _symmetric_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """s * clamp(round(x / s), -127, 127): the int8 grid with a given scale (broadcast), in x's dtype."""
    return torch.clamp(torch.round(x / scale), -127, 127) * scale


def fake_w8a8(x: torch.Tensor, w: torch.Tensor, *, act: str = "token", weight: str = "channel",
              static_scale: float | None = None) -> torch.Tensor:
    """X W^T with X and W on int8 grids (float64): ``act`` "token" (a scale per row, computed at run
    time), "tensor" (one scale for the whole X, at run time) or "static" (one scale calibrated offline,
    ``static_scale``; values beyond it clip); ``weight`` "channel" (a scale per output row) or "tensor"."""
    if act not in ACT_GRANULARITIES:
        raise ValueError(f"act must be one of {ACT_GRANULARITIES}, got {act!r}")
    if weight not in ("channel", "tensor"):
        raise ValueError(f"weight must be 'channel' or 'tensor', got {weight!r}")
    if (act == "static") != (static_scale is not None):
        raise ValueError("static_scale is needed exactly when act='static'")
    x, w = x.double(), w.double()
    if act == "token":
        sx = x.abs().amax(1, keepdim=True) / 127
    elif act == "tensor":
        sx = x.abs().max() / 127
    else:
        sx = torch.tensor(static_scale, dtype=torch.float64)
    sw = (w.abs().amax(1, keepdim=True) if weight == "channel" else w.abs().max()) / 127
    sx, sw = torch.where(sx > 0, sx, 1.0), torch.where(sw > 0, sw, 1.0)
    return _symmetric_int8(x, sx) @ _symmetric_int8(w, sw).T


def relative_error(y_hat: torch.Tensor, y: torch.Tensor) -> float:
    """||Y_hat - Y|| / ||Y|| (Frobenius)."""
    return float((y_hat - y).norm() / y.norm())


class W8A8Linear(nn.Module):
    """An nn.Linear replacement that quantizes its input per token and its weight per channel (fake
    quantization in float64: the values the int8 kernel computes, without the interpreter's cost)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        wq, ws = quantize_per_channel(weight)
        self.register_buffer("w_hat", wq.double() * ws.double()[:, None])     # (N, K)
        self.out_dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_per_token(x2.double())
        y = (xq.double() * xs.double()[:, None]) @ self.w_hat.T
        return y.to(self.out_dtype).reshape(*shape[:-1], -1)


def _fold(block: nn.Module, producer: str, readers: tuple[str, ...], s: torch.Tensor) -> None:
    """Equation (1) in place: the producer's outputs divided by s, the readers' weight columns multiplied by s."""
    prod = block.get_submodule(producer)
    if isinstance(prod, nn.Linear):
        prod.weight.div_(s[:, None])                          # rows of W_up: its outputs become u / s
    else:
        prod.weight.div_(s)                                   # RMSNorm gain: its outputs become x / s
    for r in readers:
        block.get_submodule(r).weight.mul_(s[None, :])        # W diag(s)


@torch.no_grad()
def smooth_model(model: GPT, tokens: torch.Tensor, alpha: float) -> GPT:
    """A copy of ``model`` with every block's smoothing of equation (1) folded in, s from equation (2)
    on calibration ``tokens``; in full precision it computes the same function (up to rounding)."""
    out = copy.deepcopy(model)
    for i, block in enumerate(out.blocks):
        names = [f"blocks.{i}.{readers[0]}" for _, readers in SMOOTH_GROUPS]
        inputs = linear_inputs(out, tokens, names)            # X of this block, after earlier blocks' smoothing
        for (producer, readers), name in zip(SMOOTH_GROUPS, names):
            weights = [block.get_submodule(r).weight for r in readers]
            _fold(block, producer, readers, smooth_scales(act_absmax(inputs[name]), weights, alpha))
    return out


@torch.no_grad()
def plant_outliers(model: GPT, channels: list[int], factor: float) -> GPT:
    """A copy of ``model`` computing the same function with outlier activation channels: equation (1)
    run backwards with s_k = 1 / factor on ``channels`` of every smoothed input (their activations grow
    by ``factor``, the weight columns that read them shrink by it).

    A mechanism check, circular by construction: smoothing is built to undo exactly such a rescaling,
    so recovering the float loss here proves the folds are exact and complete, not that SmoothQuant
    works on real outliers (see the SmolLM2 layers of :mod:`kernels.quant.calibration` for those)."""
    out = copy.deepcopy(model)
    for block in out.blocks:
        for producer, readers in SMOOTH_GROUPS:
            K = block.get_submodule(readers[0]).weight.shape[1]
            s = torch.ones(K, dtype=block.get_submodule(readers[0]).weight.dtype)
            s[channels] = 1.0 / factor
            _fold(block, producer, readers, s)
    return out


def w8a8_model(model: GPT) -> GPT:
    """A copy of ``model`` with every linear of every block replaced by :class:`W8A8Linear`."""
    out = copy.deepcopy(model)
    for block in out.blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, W8A8Linear(child.weight.data))
    return out
