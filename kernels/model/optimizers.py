"""SGD, SGD with momentum, Adam and AdamW on the tiny GPT, side by side:
``python -m kernels.model.optimizers`` writes models/tiny-gpt/optimizers.json.

Every run starts from the same initialization, sees the same batches in the same order, follows
the same schedule shape (the training recipe's warm-up and cosine, :func:`kernels.model.train.lr_at`,
scaled to each run's peak learning rate) and clips the gradient norm at 1; only the update rule
and its peak learning rate differ. Each optimizer is run at a few peak learning rates (a short
sweep, not a tuning study), because comparing optimizers at one shared learning rate compares
learning rates, not optimizers. The chapter plots the best run of each.

Deterministic for a given torch version and thread count (seeded, one thread), so
tests/test_model.py re-runs the first steps and checks the logged losses.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kernels.model import data
from kernels.model.gpt import GPT, GPTConfig, MODEL_DIR
from kernels.model.train import SEED, evaluate, lr_at, param_groups, validation_slice

RESULTS = MODEL_DIR / "optimizers.json"
SEED_RESULTS = MODEL_DIR / "optimizer_seeds.json"
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1          # AdamW only: the other three run without any decay


def make_optimizer(name: str, model: GPT, lr: float) -> torch.optim.Optimizer:
    """The four update rules, in the order the chapter derives them."""
    if name == "SGD":                      # theta -= lr * g
        return torch.optim.SGD(model.parameters(), lr=lr)
    if name == "SGD + momentum":           # u = 0.9 u + g;  theta -= lr * u
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if name == "Adam":                     # theta -= lr * m_hat / (sqrt(v_hat) + eps)
        return torch.optim.Adam(model.parameters(), lr=lr, betas=BETAS, eps=1e-8)
    if name == "AdamW":                    # Adam, and theta -= lr * wd * theta on the matrices
        return torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=lr, betas=BETAS, eps=1e-8)
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(SWEEP)}")


# Peak learning rates tried per optimizer: plain SGD needs steps hundreds of times larger than
# Adam's, because its step is the raw gradient, not a normalized one.
SWEEP = {
    "SGD": (0.1, 0.3, 1.0),
    "SGD + momentum": (0.01, 0.03, 0.1),
    "Adam": (1e-3, 3e-3, 1e-2),
    "AdamW": (1e-3, 3e-3, 1e-2),
}


def run(name: str, peak_lr: float, *, steps: int, batch_size: int, eval_every: int, config: GPTConfig,
        schedule_steps: int | None = None, progress: bool = True, seed: int = SEED) -> dict:
    """One training run of ``steps`` steps on a schedule of ``schedule_steps`` (default: ``steps``;
    a shorter re-run of the first steps keeps the full run's schedule); returns the per-step
    training losses and the validation curve. ``seed`` draws both the initialization and the batches."""
    total = schedule_steps or steps
    torch.manual_seed(seed)
    train_tokens, _ = data.train_val_split(data.encode(data.load_text()))
    val_x, val_y = validation_slice(config)
    gen = torch.Generator().manual_seed(seed)
    model = GPT(config)
    opt = make_optimizer(name, model, peak_lr)
    train_loss, val_curve = [], []
    for step in tqdm(range(1, steps + 1), desc=f"{name} lr={peak_lr:g}", unit="step", disable=not progress,
                     leave=False):
        lr = lr_at(step - 1, max_lr=peak_lr, min_lr=peak_lr / 10, warmup=min(50, total // 4), total=total)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.get_batch(train_tokens, batch_size, config.block_size, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_loss.append(round(loss.item(), 5))
        if step % eval_every == 0 or step == steps:
            val_curve.append([step, round(evaluate(model, val_x, val_y), 5)])
    return {"optimizer": name, "peak_lr": peak_lr, "seed": seed, "train_loss": train_loss, "val_loss": val_curve}


def race(*, steps: int, batch_size: int, eval_every: int, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    config = GPTConfig()
    start = time.perf_counter()
    runs = [run(name, lr, steps=steps, batch_size=batch_size, eval_every=eval_every, config=config)
            for name, lrs in SWEEP.items() for lr in lrs]
    return {"steps": steps, "batch_size": batch_size, "block_size": config.block_size, "eval_every": eval_every,
            "seed": SEED, "threads": threads, "torch": torch.__version__, "betas": list(BETAS),
            "weight_decay_adamw": WEIGHT_DECAY, "grad_clip": 1.0, "seconds": round(time.perf_counter() - start, 1),
            "command": "python -m kernels.model.optimizers", "runs": runs}


def seed_runs(results: dict, seeds: tuple[int, ...]) -> dict:
    """Each optimizer's best peak learning rate (chosen on the sweep's seed) again at other seeds:
    new initialization and new batch order, everything else as in the sweep. Gives the spread a
    comparison between optimizers must be read against."""
    torch.set_num_threads(results["threads"])
    config = GPTConfig()
    start = time.perf_counter()
    runs = [run(name, best["peak_lr"], steps=results["steps"], batch_size=results["batch_size"],
                eval_every=results["eval_every"], config=config, seed=seed)
            for name, best in best_runs(results).items() for seed in seeds]
    return {"steps": results["steps"], "batch_size": results["batch_size"], "eval_every": results["eval_every"],
            "seeds": list(seeds), "threads": results["threads"], "torch": torch.__version__,
            "seconds": round(time.perf_counter() - start, 1),
            "command": "python -m kernels.model.optimizers --seeds " + " ".join(map(str, seeds)), "runs": runs}


def final_losses_by_seed(results: dict, seeds_results: dict) -> dict[str, list[float]]:
    """Final validation loss of each optimizer's best run, the sweep's seed first, then the other seeds."""
    finals = {name: [r["val_loss"][-1][1]] for name, r in best_runs(results).items()}
    for r in seeds_results["runs"]:
        finals[r["optimizer"]].append(r["val_loss"][-1][1])
    return finals


def best_runs(results: dict) -> dict[str, dict]:
    """Each optimizer's run with the lowest final validation loss."""
    best: dict[str, dict] = {}
    for r in results["runs"]:
        if r["optimizer"] not in best or r["val_loss"][-1][1] < best[r["optimizer"]]["val_loss"][-1][1]:
            best[r["optimizer"]] = r
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.model.optimizers", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seeds", type=int, nargs="+",
                   help=f"re-run each optimizer's best rate of {RESULTS.name} at these seeds, into {SEED_RESULTS.name}")
    args = p.parse_args(argv)
    if args.seeds:
        spread = seed_runs(json.loads(RESULTS.read_text()), tuple(args.seeds))
        SEED_RESULTS.write_text(json.dumps(spread) + "\n")
        for name, finals in final_losses_by_seed(json.loads(RESULTS.read_text()), spread).items():
            print(f"{name:16} final validation loss by seed: {', '.join(f'{v:.3f}' for v in finals)}")
        print(f"wrote {SEED_RESULTS} ({spread['seconds']:.0f} s)")
        return 0
    results = race(steps=args.steps, batch_size=args.batch_size, eval_every=args.eval_every)
    args.out.write_text(json.dumps(results) + "\n")
    for name, r in best_runs(results).items():
        print(f"{name:16} best peak lr {r['peak_lr']:g}: validation loss {r['val_loss'][-1][1]:.3f}")
    print(f"wrote {args.out} ({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
