"""Train short, test long: three small GPTs that differ only in how attention sees position.

The ALiBi paper's experiment (Press, Smith and Lewis, 2022), at the course's scale: the same model
(kernels.model.gpt's blocks: 2 layers, d_model 64, 4 query heads sharing 2 K/V heads, SwiGLU,
byte-level Shakespeare from data/shakespeare), the same data order and seed, trained on windows of
64 tokens with

* ``rope``: the tiny GPT's rotary embedding (theta 10000),
* ``alibi``: no embedding, ALiBi's bias -m_h (i - j) on the scores, slopes for 4 heads,
* ``nope``: nothing but the causal mask,

then evaluated on windows of 64 to 512 tokens of the held-out text. The checkpoints and the measured
losses are committed (models/position-extrapolation/); reproduce them with
``python -m kernels.position.extrapolation`` (about a minute per model on one CPU core).

Shapes: idx (B, T) token ids; logits (B, T, V).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.model import data
from kernels.model.gpt import GPT, GPTConfig, add_rms_norm_torch
from kernels.position.alibi import alibi_attention_ref, alibi_slopes
from kernels.position.rope import rope_cos_sin, rope_frequencies, rope_ref

MODES = ("rope", "alibi", "nope")
CONFIG = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=160, block_size=64)
TRAIN = dict(steps=400, batch_size=16, max_lr=3e-3, min_lr=3e-4, warmup=30, weight_decay=0.1, seed=1234)
EVAL_LENGTHS = (32, 64, 128, 256, 512)
EVAL_TOKENS = 4096                       # per length: 4096 / L windows of the held-out text
OUT_DIR = Path(__file__).resolve().parents[2] / "models" / "position-extrapolation"


def forward(model: GPT, idx: torch.Tensor, mode: str, probs: list | None = None) -> torch.Tensor:
    """Logits of ``model`` with position given by ``mode`` (one of MODES).

    With a list ``probs``, each layer's attention probabilities (B, Hq, T, T) are appended to it.
    """
    if mode not in MODES:
        raise ValueError(f"forward: mode must be one of {MODES}, got {mode!r}")
    cfg = model.config
    B, T = idx.shape
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    slopes = alibi_slopes(Hq).float() if mode == "alibi" else torch.zeros(Hq)
    cos, sin = rope_cos_sin(rope_frequencies(D, cfg.rope_theta)[0], T, device=idx.device)
    x = model.wte(idx)                                                    # (B, T, C)
    for block in model.blocks:
        attn, h = block.attn, block.norm1(x)
        q = attn.wq(h).view(B, T, Hq, D)
        k = attn.wk(h).view(B, T, Hkv, D)
        v = attn.wv(h).view(B, T, Hkv, D)
        if mode == "rope":
            q, k = rope_ref(q, k, cos, sin)
        o = alibi_attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), slopes, causal=True)
        if probs is not None:                                             # P = attention applied to V = I
            eye = torch.eye(T, device=idx.device).expand(B, Hkv, T, T)
            probs.append(alibi_attention_ref(q.transpose(1, 2), k.transpose(1, 2), eye, slopes, causal=True))
        a = attn.wo(o.transpose(1, 2).reshape(B, T, Hq * D))
        x, hn = add_rms_norm_torch(x, a, block.norm2.weight, cfg.norm_eps)
        x = x + block.mlp(hn)
    return model.norm_f(x) @ model.wte.weight.T


def loss(model: GPT, x: torch.Tensor, y: torch.Tensor, mode: str) -> torch.Tensor:
    logits = forward(model, x, mode)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def lr_at(step: int, steps: int, max_lr: float, min_lr: float, warmup: int) -> float:
    if step < warmup:
        return max_lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * t))


def train(mode: str, *, steps: int = TRAIN["steps"], progress: bool = False) -> tuple[GPT, list[float]]:
    """Train one model from the fixed seed; returns it and the per-step training losses."""
    torch.manual_seed(TRAIN["seed"])
    model = GPT(CONFIG)
    train_tokens, _ = data.train_val_split(data.encode(data.load_text()))
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["max_lr"], betas=(0.9, 0.95),
                            weight_decay=TRAIN["weight_decay"])
    gen = torch.Generator().manual_seed(TRAIN["seed"])                   # the same batches for every mode
    losses = []
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc=mode)
    for step in it:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, TRAIN["steps"], TRAIN["max_lr"], TRAIN["min_lr"], TRAIN["warmup"])
        x, y = data.get_batch(train_tokens, TRAIN["batch_size"], CONFIG.block_size, generator=gen)
        value = loss(model, x, y, mode)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(value.detach()))
    return model.eval(), losses


@torch.no_grad()
def evaluate(model: GPT, mode: str, length: int, n_tokens: int = EVAL_TOKENS) -> float:
    """Mean next-token loss (nats) over windows of ``length`` tokens from the start of the held-out text."""
    _, val = data.train_val_split(data.encode(data.load_text()))
    x, y = data.fixed_windows(val, max(1, n_tokens // length), length)
    return float(loss(model, x, y, mode))


def load(mode: str, directory: Path = OUT_DIR) -> GPT:
    model = GPT(CONFIG)
    model.load_state_dict(torch.load(directory / f"{mode}.pt", map_location="cpu", weights_only=True))
    return model.eval()


def results(directory: Path = OUT_DIR) -> dict:
    return json.loads((directory / "results.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"config": json.loads(CONFIG.to_json()), "train": TRAIN, "eval_lengths": list(EVAL_LENGTHS),
           "eval_tokens": EVAL_TOKENS, "torch": torch.__version__, "threads": 1,
           "command": "python -m kernels.position.extrapolation", "models": {}}
    for mode in MODES:
        start = time.time()
        model, losses = train(mode, progress=True)
        torch.save(model.state_dict(), args.out / f"{mode}.pt")
        out["models"][mode] = {"train_loss_last50": sum(losses[-50:]) / 50, "seconds": round(time.time() - start, 1),
                               "val_loss": {str(L): evaluate(model, mode, L) for L in EVAL_LENGTHS}}
        print(mode, out["models"][mode])
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
