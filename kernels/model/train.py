"""Train the course's tiny GPT on the CPU: ``python -m kernels.model.train`` (``make model``).

Writes models/tiny-gpt/{model.pt, config.json, train_log.csv, metrics.json}. Deterministic for a
given torch version and thread count: the seed, the batches and the thread count are fixed.

The recipe: AdamW (betas 0.9/0.95, weight decay 0.1 on the matrices only, not on norms), linear
warm-up then cosine decay of the learning rate, gradient clipping at norm 1, random windows of
``block_size`` bytes from the first 90% of the text. The validation loss is measured on a fixed
slice (the first ``VAL_WINDOWS`` non-overlapping windows of the held-out last 10%), so the number
in metrics.json can be reproduced exactly by tests/test_model.py.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kernels.model import data
from kernels.model.gpt import GPT, GPTConfig, MODEL_DIR

SEED = 1337
VAL_WINDOWS = 64          # 64 x 128 = 8192 validation tokens


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warm-up to max_lr over ``warmup`` steps, then cosine decay to min_lr at ``total``."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))


def adamw_update(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, *,
                 lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
    """One AdamW step on p in place, written out (Loshchilov and Hutter), as torch.optim.AdamW does it.

        p <- p - lr * wd * p                              (decoupled weight decay: not part of the gradient)
        m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2   (first and second moment estimates)
        p <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)   (bias-corrected, t = step >= 1)
    """
    b1, b2 = betas
    p.mul_(1 - lr * weight_decay)
    m.mul_(b1).add_(grad, alpha=1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    m_hat = m / (1 - b1 ** step)
    v_hat = v / (1 - b2 ** step)
    p.sub_(lr * m_hat / (v_hat.sqrt() + eps))


def param_groups(model: GPT, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (embedding included), none on the RMSNorm gains."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *, clip: float = 1.0,
               mark=None) -> torch.Tensor:
    """One step of the recipe on the batch x, y (B, T): forward and loss, the previous step's gradients
    dropped, backward, gradients clipped to norm ``clip``, the optimizer's update. Returns the loss
    (detached). ``mark(label)``, if given, is called at the end of each phase ("forward", "backward",
    "clip", "optimizer"): how a memory probe splits the step."""
    mark = mark or (lambda label: None)
    logits = model(x)                                             # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())     # targets shifted by one
    mark("forward")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    mark("backward")
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    mark("clip")
    opt.step()
    mark("optimizer")
    return loss.detach()


@torch.no_grad()
def evaluate(model: GPT, x: torch.Tensor, y: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats per byte) over the windows x, y (N, T)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(x), batch):
        logits = model(x[i: i + batch])
        total += float(F.cross_entropy(logits.flatten(0, 1), y[i: i + batch].flatten(), reduction="sum"))
        count += y[i: i + batch].numel()
    model.train(was_training)
    return total / count


def validation_slice(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = data.encode(data.load_text())
    _, val = data.train_val_split(tokens)
    return data.fixed_windows(val, VAL_WINDOWS, config.block_size)


def run(*, steps: int, batch_size: int, max_lr: float, min_lr: float, warmup: int, weight_decay: float,
        eval_every: int, threads: int, config: GPTConfig, schedule_steps: int | None = None,
        progress: bool = True) -> tuple[GPT, list[dict]]:
    """The training loop: ``steps`` steps of the recipe on a schedule of ``schedule_steps`` (default
    ``steps``; a re-run of the first steps keeps the full run's schedule). Returns the model and the
    log rows (step 0 holds the untrained model's validation loss)."""
    total = schedule_steps or steps
    torch.manual_seed(SEED)
    torch.set_num_threads(threads)
    tokens = data.encode(data.load_text())
    train_tokens, val_tokens = data.train_val_split(tokens)
    val_x, val_y = data.fixed_windows(val_tokens, VAL_WINDOWS, config.block_size)
    gen = torch.Generator().manual_seed(SEED)

    model = GPT(config)
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=max_lr, betas=(0.9, 0.95), eps=1e-8)
    log_rows = []
    start = time.perf_counter()
    initial_val = evaluate(model, val_x, val_y)
    log_rows.append({"step": 0, "tokens": 0, "train_loss": "", "val_loss": round(initial_val, 5),
                     "lr": 0.0, "elapsed_s": 0.0})
    bar = tqdm(range(1, steps + 1), desc="training tiny-gpt", unit="step", disable=not progress)
    for step in bar:
        lr = lr_at(step - 1, max_lr=max_lr, min_lr=min_lr, warmup=warmup, total=total)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.get_batch(train_tokens, batch_size, config.block_size, gen)
        loss_value = train_step(model, opt, x, y).item()
        row = {"step": step, "tokens": step * batch_size * config.block_size,
               "train_loss": round(loss_value, 5), "val_loss": "", "lr": lr,
               "elapsed_s": round(time.perf_counter() - start, 2)}
        if step % eval_every == 0 or step == steps:
            row["val_loss"] = round(evaluate(model, val_x, val_y), 5)
            bar.set_postfix(loss=f"{loss_value:.3f}", val=f"{row['val_loss']:.3f}")
        log_rows.append(row)
    return model, log_rows


def train(out_dir: Path, *, steps: int, batch_size: int, max_lr: float, min_lr: float, warmup: int,
          weight_decay: float, eval_every: int, threads: int, config: GPTConfig) -> dict:
    """Runs the loop and writes the checkpoint, the log and the metrics into ``out_dir``."""
    start = time.perf_counter()
    model, log_rows = run(steps=steps, batch_size=batch_size, max_lr=max_lr, min_lr=min_lr, warmup=warmup,
                          weight_decay=weight_decay, eval_every=eval_every, threads=threads, config=config)
    initial_val = log_rows[0]["val_loss"]
    val_x, val_y = validation_slice(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    val_loss = evaluate(model, val_x, val_y)
    seconds = time.perf_counter() - start
    torch.save(model.state_dict(), out_dir / "model.pt")
    (out_dir / "config.json").write_text(config.to_json() + "\n")
    with open(out_dir / "train_log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(log_rows[0]))
        writer.writeheader()
        writer.writerows(log_rows)
    metrics = {
        "val_loss": val_loss,
        "val_loss_initial": initial_val,
        "val_slice": {"split": "last 10% of data/shakespeare/tragedies.txt", "windows": VAL_WINDOWS,
                      "block_size": config.block_size, "tokens": VAL_WINDOWS * config.block_size},
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": steps, "batch_size": batch_size, "tokens_seen": steps * batch_size * config.block_size,
        "max_lr": max_lr, "min_lr": min_lr, "warmup": warmup, "weight_decay": weight_decay,
        "betas": [0.9, 0.95], "grad_clip": 1.0, "seed": SEED, "threads": threads,
        "train_seconds": round(seconds, 1), "torch": torch.__version__,
        "command": "python -m kernels.model.train",
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.model.train", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=MODEL_DIR)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--max-lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    metrics = train(args.out, steps=args.steps, batch_size=args.batch_size, max_lr=args.max_lr,
                    min_lr=args.min_lr, warmup=args.warmup, weight_decay=args.weight_decay,
                    eval_every=args.eval_every, threads=args.threads, config=GPTConfig())
    print(f"val_loss {metrics['val_loss']:.4f} nats/byte after {metrics['steps']} steps "
          f"({metrics['train_seconds']:.0f} s); wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
