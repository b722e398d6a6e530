"""AWQ: activation-aware weight quantization, a per-input-channel scale searched on calibration data.

Weight-only quantization rounds W (N, K) to b bits per group of g input channels. Its effect on the
layer's output is (W - Q(W)) x: the error in column k is multiplied by the activation x_k, so the
columns that meet large activations (the *salient* channels, about 1% of them in the AWQ paper)
matter most. Keeping them in fp16 works but breaks the uniform format; AWQ instead scales them up
before rounding (Lin et al., 2024, section 3.2):

    Q(W diag(s)) diag(s)^-1 x                                            (1)

Multiplying column k by s_k > 1 leaves the group's scale nearly unchanged (unless the column holds
the group's maximum), so the column's rounding error, relative to its own size, shrinks by about
1/s_k. The factor is searched, not solved: with x_bar_k = mean_t |x_tk| on calibration tokens,

    s = x_bar^alpha / sqrt(max(x_bar^alpha) min(x_bar^alpha)),   alpha in {0, 1/20, ..., 19/20}   (2)

and alpha is the one with the smallest output error ||X W^T - X (Q(W diag(s)) diag(s)^-1)^T||^2 on the
calibration activations (a grid of 20 as in the reference code, mit-han-lab/llm-awq
awq/quantize/auto_scale.py). diag(s)^-1 on x is folded into the operation that produces x, as in
SmoothQuant; this module applies equation (1) to the weights directly (fake quantization), which
computes the same values.

Linears that read the same input share one s: (W_q, W_k, W_v), (W_gate, W_up); W_o and W_down each
have their own. AWQ's second search (clipping the weight range, ``auto_clip``) is left out.

*Duo scaling* (AutoAWQ, casper-hansen/AutoAWQ awq/quantize/quantizer.py, ``duo_scaling=True``) divides
by a weight statistic too: s = x_bar^alpha / w_bar^(1 - alpha), with w_bar_k the mean over output rows
of |W_nk| relative to the largest |W| of its group (so every group's weights count on a 0..1 scale).
"""
from __future__ import annotations

import torch

from kernels.model.gpt import GPT
from kernels.quant.calibration import act_absmean, linear_inputs, with_weights
from kernels.quant.intq import fake_quantize

# linears of one block that read one input, and so share one AWQ scale
SHARED_INPUTS = (("attn.wq", "attn.wk", "attn.wv"), ("attn.wo",), ("mlp.w_gate", "mlp.w_up"), ("mlp.w_down",))


def rtn(w: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """Round-to-nearest, asymmetric, per group of ``group_size`` input channels (``None``: per output channel)."""
    if group_size is None:
        return fake_quantize(w, bits, symmetric=False, granularity="channel")
    return fake_quantize(w, bits, symmetric=False, granularity="group", group_size=group_size)


def awq_scales(x_absmean: torch.Tensor, alpha: float, w_absmean: torch.Tensor | None = None) -> torch.Tensor:
    """Equation (2): s = x_bar^alpha (or x_bar^alpha / w_bar^(1 - alpha) with ``w_absmean``, duo
    scaling), normalized so that max(s) min(s) = 1."""
    s = x_absmean.clamp(min=1e-4) ** alpha
    if w_absmean is not None:
        s = (s / (w_absmean ** (1 - alpha) + 1e-4)).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_absmean(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """Duo scaling's w_bar (K,): mean over rows of |W_nk| / max |W| of its group (per row if ``None``)."""
    N, K = w.shape
    g = group_size or K
    wg = w.abs().reshape(N, K // g, g)
    return (wg / (wg.amax(-1, keepdim=True) + 1e-6)).reshape(N, K).mean(0)


def scaled_quantize(w: torch.Tensor, s: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """Equation (1) on the weight: Q(W diag(s)) diag(s)^-1, (N, K)."""
    return rtn(w * s[None, :], bits, group_size) / s[None, :]


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Mean squared output error (1 / (T N)) ||X W^T - X W_hat^T||^2."""
    return float((x @ (w - w_hat).T).pow(2).mean())


def awq_search(x: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int | None,
               n_grid: int = 20, *, duo: bool = False) -> tuple[torch.Tensor, float, list[float]]:
    """The scale s (K,) of equation (2) whose alpha minimises the output error of the linears ``weights``
    (each (N_i, K)) on the calibration inputs x (T, K); returns (s, alpha, error for every alpha).
    ``duo``: AutoAWQ's duo scaling (see the module docstring)."""
    w = torch.cat(weights, 0)                                          # (sum N_i, K): one output error
    x_bar = act_absmean(x)
    w_bar = weight_absmean(w, group_size) if duo else None
    errors = []
    for i in range(n_grid):
        s = awq_scales(x_bar, i / n_grid, w_bar)
        errors.append(output_error(x, w, scaled_quantize(w, s, bits, group_size)))
    best = min(range(n_grid), key=errors.__getitem__)
    return awq_scales(x_bar, best / n_grid, w_bar), best / n_grid, errors


def rtn_model(model: GPT, bits: int, group_size: int | None) -> GPT:
    """A copy of ``model`` with every block's linears rounded to nearest."""
    names = [f"blocks.{i}.{n}" for i in range(len(model.blocks)) for group in SHARED_INPUTS for n in group]
    return with_weights(model, {n: rtn(model.get_submodule(n).weight, bits, group_size) for n in names})


@torch.no_grad()
def awq_model(model: GPT, tokens: torch.Tensor, bits: int, group_size: int | None) -> tuple[GPT, dict[str, float]]:
    """A copy of ``model`` with every linear quantized by AWQ (scales searched on the float model's
    inputs for ``tokens``), and the alpha chosen for each group of linears that share an input."""
    first = [f"blocks.{i}.{group[0]}" for i in range(len(model.blocks)) for group in SHARED_INPUTS]
    inputs = linear_inputs(model, tokens, first)
    new, alphas = {}, {}
    for name in first:
        prefix = name.rsplit(".", 2)[0]                                # blocks.i
        group = next(g for g in SHARED_INPUTS if name.endswith(g[0]))
        ws = [model.get_submodule(f"{prefix}.{n}").weight for n in group]
        s, alphas[name], _ = awq_search(inputs[name], ws, bits, group_size)
        for n, w in zip(group, ws):
            new[f"{prefix}.{n}"] = scaled_quantize(w, s, bits, group_size)
    return with_weights(model, new), alphas
