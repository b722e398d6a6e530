"""A short fine-tune of the tiny GPT at 4x its training length with YaRN's frequencies.

YaRN (Peng et al., 2023) and position interpolation (Chen et al., 2023) both prescribe a brief
fine-tune at the new length after changing the frequencies. This is that step at the course's
scale: the committed tiny GPT (trained on 128 tokens), YaRN with factor 4 (original length 128),
AdamW for ``STEPS`` steps on random 512-token windows of the training text, then the per-position
loss on the same held-out windows the rope-scaling chapter uses. Only the losses are committed
(models/position-extrapolation/yarn-finetune.json); reproduce with
``python -m kernels.position.yarn_finetune`` (a few minutes on one CPU core).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from kernels.model import data
from kernels.model.gpt import load_pretrained
from kernels.position.rope import rope_frequencies
from kernels.position.tiny_gpt import forward_at, mean_nll, position_nll, sliding_window_nll

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
LENGTH = 512
FINETUNE = dict(steps=150, batch_size=4, lr=3e-4, weight_decay=0.1, seed=7)
BANDS = ((0, 128), (128, 256), (256, 448), (448, 511))
OUT = Path(__file__).resolve().parents[2] / "models" / "position-extrapolation" / "yarn-finetune.json"


def finetune(steps: int = FINETUNE["steps"], *, progress: bool = False):
    """The tiny GPT fine-tuned with YaRN tables on 512-token windows; returns (model, losses)."""
    torch.manual_seed(FINETUNE["seed"])
    model = load_pretrained().train()
    cfg = model.config
    inv_freq, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, YARN)
    train_tokens, _ = data.train_val_split(data.encode(data.load_text()))
    opt = torch.optim.AdamW(model.parameters(), lr=FINETUNE["lr"], weight_decay=FINETUNE["weight_decay"])
    gen = torch.Generator().manual_seed(FINETUNE["seed"])
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="YaRN fine-tune")
    losses = []
    for _ in it:
        x, y = data.get_batch(train_tokens, FINETUNE["batch_size"], LENGTH, generator=gen)
        loss = mean_nll(forward_at(model, x, inv_freq=inv_freq, attention_factor=factor), y).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return model.eval(), losses


def band_losses(model) -> list[float]:
    """Mean loss per band of positions over the rope-scaling chapter's 4 held-out 512-token windows."""
    _, val = data.train_val_split(data.encode(data.load_text()))
    x, y = data.fixed_windows(val, 4, LENGTH)
    nll = position_nll(model, x, y, YARN)
    return [float(nll[a:b].mean()) for a, b in BANDS]


def sliding_baseline() -> float:
    """The untouched tiny GPT shown only the 128 tokens before each of positions 448..510, same 4 windows."""
    _, val = data.train_val_split(data.encode(data.load_text()))
    model = load_pretrained()
    return float(torch.cat([sliding_window_nll(model, val[w * LENGTH: w * LENGTH + LENGTH + 1], 448, 511, 128)
                            for w in range(4)]).mean())


def main() -> int:
    torch.set_num_threads(1)
    start = time.time()
    model, losses = finetune(progress=True)
    out = {"scaling": YARN, "length": LENGTH, "finetune": FINETUNE, "bands": [list(b) for b in BANDS],
           "before": band_losses(load_pretrained()), "after": band_losses(model),
           "sliding_window_448_510": sliding_baseline(), "train_loss": losses,
           "seconds": round(time.time() - start, 1), "threads": 1, "torch": torch.__version__,
           "command": "python -m kernels.position.yarn_finetune"}
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print({k: out[k] for k in ("before", "after", "sliding_window_448_510", "seconds")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
