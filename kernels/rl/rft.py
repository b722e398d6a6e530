"""Rejection sampling as a data filter: best-of-n with the verifier, RFT on the kept samples, pass@k.

Rejection-sampling fine-tuning (RFT, Yuan et al. 2023) samples k completions per training prompt
from the SFT model, keeps those the verifier accepts (distinct ones only), and fine-tunes on them
with the ordinary SFT loss. Whether that adds capability or only sharpens the sampling distribution
is measured with pass@k, the probability that at least one of k samples is correct, estimated
without bias from n >= k samples of which c are correct (Chen et al. 2021):

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)      (1 when n - c < k)

The product form never forms a binomial coefficient (C(200, 100) ~ 9e58 overflows float32). The
plug-in estimate 1 - (1 - c/n)^k is biased (it samples with replacement); it is the broken variant.

``python -m kernels.rl.rft`` samples the training prompts from models/rl/sft, fine-tunes on the kept
samples (and, as controls, on every correct sample and on the reference answers of the same
prompts), samples the held-out set n times per model, and writes models/rl/rft/metrics.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from tqdm import tqdm

from kernels import runtime
from kernels.model.train import lr_at
from kernels.rl import sft, task

OUT = sft.OUT_DIR / "rft"


# ---------------------------------------------------------------- the verifier as a filter

def answers(completions: torch.Tensor) -> list[bytes | None]:
    """Each completion (B, L) cut at its first END, as bytes; None where it has no END."""
    return [bytes(row[: row.index(task.END)]) if task.END in row else None for row in completions.tolist()]


def keep_correct(completions: torch.Tensor, pairs: torch.Tensor, group_size: int, *,
                 distinct: bool = True) -> list[tuple[int, int, str]]:
    """The verifier as a filter: (a, b, answer) for every accepted completion; completions (P*G, L) are
    G samples of each of P pairs (P*G, 2), in groups. ``distinct`` keeps one copy of each distinct
    accepted answer per prompt (Yuan et al. 2023), else every accepted sample."""
    ok = task.rewards(completions, pairs).bool().tolist()
    kept, seen = [], set()
    for i, (ans, (a, b), good) in enumerate(zip(answers(completions), pairs.tolist(), ok)):
        if not good:
            continue
        key = (i // group_size, ans)
        if distinct and key in seen:
            continue
        seen.add(key)
        kept.append((a, b, ans.decode()))
    return kept


def sample_groups(model, pairs: torch.Tensor, n: int, gen: torch.Generator, *, chunk: int = 125,
                  temperature: float = 1.0, desc: str | None = None) -> dict:
    """n samples for each pair (P, 2), ``chunk`` prompts at a time: per-prompt correct counts c (P,),
    first correct sample's index (P,; -1 when none), and the distinct-kept RFT examples."""
    counts, first, kept = [], [], []
    for s in tqdm(range(0, len(pairs), chunk), desc=desc, disable=desc is None, leave=False):
        p = pairs[s: s + chunk]
        rep = p.repeat_interleave(n, 0)                                              # (chunk*n, 2)
        comp = task.sample(model, rep, temperature=temperature, generator=gen)
        r = task.rewards(comp, rep).view(len(p), n)                                 # (chunk, n)
        counts += r.sum(1).long().tolist()
        first += torch.where(r.any(1), r.argmax(1), torch.full((len(p),), -1)).tolist()
        kept += keep_correct(comp, rep, n)
    return {"c": counts, "first": first, "kept": kept}


# ---------------------------------------------------------------- pass@k, references

def pass_at_k_exact(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) with exact integers (math.comb), rounded once to float."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k_exact: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    from fractions import Fraction
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def pass_at_k_ref(n: torch.Tensor, c: torch.Tensor, k_max: int) -> torch.Tensor:
    """pass@k for k = 1..k_max of every problem, in float64: (P, k_max). n, c (P,) integer.
    1 - prod_{i=n-c+1}^{n} (1 - k/i), 1 where n - c < k; NaN where k > n (undefined)."""
    n64, c64 = n.double()[:, None], c.double()[:, None]                            # (P, 1)
    k = torch.arange(1, k_max + 1, dtype=torch.float64)[None]                       # (1, K)
    j = torch.arange(int(c.max()) if len(c) else 0, dtype=torch.float64)[None, None]   # (1, 1, J)
    i = n64[..., None] - j                                                           # i = n, n-1, ..., n-c+1
    factor = torch.where(j < c64[..., None], 1 - k[..., None] / i, torch.ones(()))  # (P, K, J)
    out = 1 - factor.prod(-1)
    out = torch.where(n64 - c64 < k, torch.ones(()), out)
    return torch.where(k > n64, torch.full((), float("nan"), dtype=torch.float64), out)


def pass_at_k_biased(n: torch.Tensor, c: torch.Tensor, k_max: int) -> torch.Tensor:
    """The plug-in estimate 1 - (1 - c/n)^k (with replacement): biased low for k > 1. (P, k_max)."""
    k = torch.arange(1, k_max + 1, dtype=torch.float64)[None]
    return 1 - (1 - c.double()[:, None] / n.double()[:, None]) ** k


# ---------------------------------------------------------------- the run

def finetune(model, examples: list[tuple[int, int]], *, steps: int, lr: float, gen: torch.Generator,
             examples_per_step: int = 96, desc: str | None = None) -> list[float]:
    """kernels.rl.sft's training path (packed, prompt-masked) on ``examples`` (pairs whose answer the
    verifier accepted, or reference answers); warm-up 20 steps, cosine to lr/10. Returns the losses."""
    pairs = torch.tensor(examples, dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    for step in tqdm(range(steps), desc=desc, disable=desc is None, leave=False):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, max_lr=lr, min_lr=lr / 10, warmup=20, total=steps)
        b = sft.batch(pairs, examples_per_step, gen, model.config.block_size, True)
        loss = sft.masked_loss(sft.packed_forward(model, b["ids"], b["positions"], sft.packed_mask(b["seq"])),
                               b["targets"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def run(out_dir: Path | None, *, train_prompts: int = 3000, k: int = 16, n_eval: int = 128, steps: int = 200,
        lr: float = 3e-4, seed: int = 0, threads: int = 1, progress: bool = True,
        stop_after_collect: int | None = None) -> dict:
    """The committed run (see the module docstring). ``stop_after_collect`` samples only that many
    training prompts and returns (a slice for the test)."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    start = time.perf_counter()
    base = sft.load_sft()
    train_pairs, held_out = task.split_pairs()
    pool = train_pairs[:train_prompts]
    gen = torch.Generator().manual_seed(seed)
    collect = sample_groups(base, pool[:stop_after_collect] if stop_after_collect else pool, k, gen,
                            desc="sample train prompts" if progress else None)
    if stop_after_collect:
        return collect
    assert all(ans == str(a + b) for a, b, ans in collect["kept"])     # a kept answer is the reference
    distinct = [(a, b) for a, b, _ in collect["kept"]]
    # every accepted sample (no dedupe): easy prompts appear up to k times
    every = [(int(a), int(b)) for (a, b), c in zip(pool.tolist(), collect["c"]) for _ in range(c)]
    reference = [tuple(p) for p in pool.tolist()]                      # the same prompts, reference answers
    arms = {"sft": None, "rft": distinct, "rft_every_correct": every, "sft_more": reference}
    results = {}
    for name, data in arms.items():
        model = base if data is None else copy.deepcopy(base)
        losses = []
        if data is not None:
            losses = finetune(model, data, steps=steps, lr=lr, gen=torch.Generator().manual_seed(seed + 1),
                              desc=f"fine-tune {name}" if progress else None)
        model.eval()
        ev = sample_groups(model, held_out, n_eval, torch.Generator().manual_seed(seed + 2),
                           desc=f"sample held-out ({name})" if progress else None)
        results[name] = {"examples": 0 if data is None else len(data),
                         "loss_first": round(losses[0], 4) if losses else None,
                         "loss_last": round(losses[-1], 4) if losses else None,
                         "greedy_accuracy": task.accuracy(model, held_out),
                         "c": ev["c"], "first": ev["first"]}
    meta = {"train_prompts": train_prompts, "k": k, "n_eval": n_eval, "steps": steps, "lr": lr,
            "examples_per_step": 96, "temperature": 1.0, "seed": seed, "threads": threads,
            "collect": {"c": collect["c"], "first": collect["first"], "kept_distinct": len(distinct),
                        "kept_every": len(every), "rollouts": train_prompts * k},
            "models": results, "seconds": round(time.perf_counter() - start, 1),
            "torch": torch.__version__, "command": "python -m kernels.rl.rft"}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "metrics.json").write_text(json.dumps(meta) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.rl.rft", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    meta = run(args.out)
    print({m: (r["greedy_accuracy"], sum(r["c"])) for m, r in meta["models"].items()}, meta["seconds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
