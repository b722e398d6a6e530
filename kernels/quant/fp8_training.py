"""A small GPT trained with FP8 GEMMs against the same run in fp32: ``python -m kernels.quant.fp8_training``
writes models/fp8-training/runs.json.

Three arms, from the same initialization and the same batches at each seed:

* ``fp32``: the GPT as it is (every GEMM in fp32);
* ``fp8 hybrid``: :func:`kernels.quant.fp8.fp8_blocks`, every linear layer of the blocks an
  :class:`~kernels.quant.fp8.Fp8Linear` (fprop E4M3 x E4M3, dgrad and wgrad with dY in E5M2, current
  per-tensor scaling, fp32 master weights); embeddings, norms, softmax and the tied head stay fp32;
* ``fp8 e4m3``: the same with dY in E4M3 too (DeepSeek-V3's choice of format, without its
  fine-grained scales).

The model is smaller than the course's tiny GPT (2 layers, width 64, context 64) so that nine runs
take minutes on one core. Deterministic for a given torch version and thread count.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from kernels.model import data
from kernels.model.gpt import GPT, GPTConfig
from kernels.model.train import evaluate, lr_at, param_groups, train_step
from kernels.quant.fp8 import fp8_blocks

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "models" / "fp8-training" / "runs.json"
CONFIG = GPTConfig(block_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=160)
RUN = dict(steps=150, batch_size=16, max_lr=3e-3, min_lr=3e-4, warmup=15, weight_decay=0.1, eval_every=50)
VAL_WINDOWS = 64
ARMS = {"fp32": None, "fp8 hybrid": "e5m2", "fp8 e4m3": "e4m3"}


def make_model(arm: str, seed: int) -> GPT:
    """The arm's model from the seed's initialization (the same for every arm)."""
    if arm not in ARMS:
        raise ValueError(f"make_model: arm must be one of {list(ARMS)}, got {arm!r}")
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    return model if ARMS[arm] is None else fp8_blocks(copy.deepcopy(model), grad_fmt=ARMS[arm])


def run(arm: str, seed: int, *, steps: int, batch_size: int, max_lr: float, min_lr: float, warmup: int,
        weight_decay: float, eval_every: int, stop_after: int | None = None) -> dict:
    """One training run; returns the train losses of every step and the validation losses every
    ``eval_every`` steps (step 0 first). ``stop_after`` ends it early (same schedule): a log check."""
    tokens = data.encode(data.load_text())
    train_tokens, val_tokens = data.train_val_split(tokens)
    val_x, val_y = data.fixed_windows(val_tokens, VAL_WINDOWS, CONFIG.block_size)
    model = make_model(arm, seed)
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=max_lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    train_losses, val = [], [(0, round(evaluate(model, val_x, val_y), 5))]
    for step in range(1, (stop_after or steps) + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, max_lr=max_lr, min_lr=min_lr, warmup=warmup, total=steps)
        x, y = data.get_batch(train_tokens, batch_size, CONFIG.block_size, gen)
        train_losses.append(round(train_step(model, opt, x, y).item(), 5))
        if step % eval_every == 0:
            val.append((step, round(evaluate(model, val_x, val_y), 5)))
    return {"arm": arm, "seed": seed, "train_loss": train_losses, "val_loss": val}


def all_runs(seeds: tuple[int, ...] = (0, 1, 2), arms: tuple[str, ...] = tuple(ARMS)) -> dict:
    """Every arm at every seed (one thread: the numbers do not depend on the machine's cores)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    runs = [run(arm, seed, **RUN) for arm in arms for seed in seeds]
    return {"config": json.loads(CONFIG.to_json()), **RUN, "val_windows": VAL_WINDOWS, "seeds": list(seeds),
            "threads": 1, "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 1),
            "command": "python -m kernels.quant.fp8_training", "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.quant.fp8_training", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    result = all_runs(tuple(args.seeds))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result) + "\n")
    for r in result["runs"]:
        print(f"{r['arm']:>10} seed {r['seed']}: final val loss {r['val_loss'][-1][1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
