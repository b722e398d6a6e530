"""Train the small MoE GPT under each balancing method: ``python -m kernels.moe.train``.

Writes models/moe/results.json: for every method of :data:`METHODS`, the training loss, the
balancing losses, the validation loss every ``eval_every`` steps, and the expert loads of every
layer at every step (assignments per expert, integers), with the configuration, the seed, the
thread count and the command. Deterministic for a given torch version and thread count; the
notebook and tests/test_load_balancing.py re-run the first steps and compare with the log.

Every method sees the same batches from the same initial weights (the seed is reset per run).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kernels.model import data
from kernels.model.train import lr_at
from kernels.moe.model import MODEL_DIR, MoEConfig, MoEGPT

SEED = 1337
VAL_WINDOWS = 16
RESULTS = MODEL_DIR / "results.json"
# method -> the config's balance setting ("bias" routes with sigmoid scores; the others with softmax).
METHODS = {"none": "none", "switch": "switch", "z": "z", "switch+z": "switch+z", "bias": "bias"}
DEFAULTS = dict(steps=600, batch_size=16, max_lr=3e-3, min_lr=3e-4, warmup=30, weight_decay=0.1, eval_every=100)


@torch.no_grad()
def evaluate(model: MoEGPT, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    loss = float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    model.train()
    return loss


def run(method: str, *, steps: int, schedule_steps: int, batch_size: int, max_lr: float, min_lr: float,
        warmup: int, weight_decay: float, eval_every: int, config: MoEConfig | None = None,
        progress: bool = True) -> dict:
    """Train one model with ``method``'s balancing for ``steps`` steps of a ``schedule_steps`` schedule."""
    if method not in METHODS:
        raise ValueError(f"run: method must be one of {list(METHODS)}, got {method!r}")
    config = replace(config or MoEConfig(), balance=METHODS[method])
    torch.manual_seed(SEED)
    tokens = data.encode(data.load_text())
    train_tokens, val_tokens = data.train_val_split(tokens)
    val_x, val_y = data.fixed_windows(val_tokens, VAL_WINDOWS, config.block_size)
    gen = torch.Generator().manual_seed(SEED)
    model = MoEGPT(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=max_lr, betas=(0.9, 0.95))
    log = {"method": method, "train_loss": [], "balance_loss": [], "loads": [], "val": []}
    bar = tqdm(range(1, steps + 1), desc=f"moe {method}", unit="step", disable=not progress)
    for step in bar:
        lr = lr_at(step - 1, max_lr=max_lr, min_lr=min_lr, warmup=warmup, total=schedule_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.get_batch(train_tokens, batch_size, config.block_size, gen)
        lm = F.cross_entropy(model(x).flatten(0, 1), y.flatten())          # next-byte loss
        extra = model.balance_loss()                                        # 0 for "none" and "bias"
        opt.zero_grad(set_to_none=True)
        (lm + extra).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if config.balance == "bias":
            for layer in model.moe_layers:
                layer.update_bias()                                         # after the step, from its load
        log["train_loss"].append(round(lm.item(), 5))
        log["balance_loss"].append(round(float(extra.detach()), 6))
        log["loads"].append([layer.last_load.tolist() for layer in model.moe_layers])
        if step % eval_every == 0 or step == steps:
            log["val"].append([step, round(evaluate(model, val_x, val_y), 5)])
            bar.set_postfix(loss=f"{lm.item():.3f}", val=f"{log['val'][-1][1]:.3f}")
    log["final_bias"] = [[round(v, 6) for v in layer.bias.tolist()] for layer in model.moe_layers]
    return log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.moe.train", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", nargs="*", default=list(METHODS))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = dict(DEFAULTS, steps=args.steps)
    start = time.perf_counter()
    runs = [run(m, schedule_steps=args.steps, **settings) for m in args.methods]
    config = MoEConfig()
    results = {"config": json.loads(config.to_json()), "settings": settings, "seed": SEED, "threads": args.threads,
               "val_windows": VAL_WINDOWS, "torch": torch.__version__, "train_seconds": round(time.perf_counter() - start),
               "command": "python -m kernels.moe.train", "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, separators=(",", ":")) + "\n")
    for r in runs:
        print(f"{r['method']:>9}: final val loss {r['val'][-1][1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
