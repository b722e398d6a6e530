"""Rejection sampling as a data filter: best-of-n with the verifier, RFT on the kept samples, pass@k.

Rejection-sampling fine-tuning (RFT, Yuan et al. 2023) samples k completions per training prompt
from the SFT model, keeps those the verifier accepts (distinct ones only), and fine-tunes on them
with the ordinary SFT loss. Whether that adds capability or only sharpens the sampling distribution
is measured with pass@k, the probability that at least one of k samples is correct, estimated
without bias from n >= k samples of which c are correct (Chen et al. 2021):

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)      (1 when n - c < k)

The product form never forms a binomial coefficient (C(200, 100) ~ 9e58 overflows float32). The
plug-in estimate 1 - (1 - c/n)^k is biased (it samples with replacement); it is the broken variant.

The committed run uses a multi-answer version of the task: the verifier accepts a + b - 1, a + b and
a + b + 1 (``accepted``, tol = 1), so a prompt can have up to three distinct accepted strings and the
distinct filter has something to select. ``python -m kernels.rl.rft`` (seeds 0, 1, 2) samples the training
prompts from models/rl/sft, fine-tunes on the kept samples (and, as controls, on every accepted sample and
on the exact sums of the same prompts), samples held-out prompts n times per model, and writes
models/rl/rft/seed{s}.json.
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


def accepted(a: int, b: int, tol: int) -> set[bytes]:
    """The answers the verifier accepts for a + b: the decimal strings of a + b + d, |d| <= tol (tol = 0: the
    task's one answer; tol = 1: the multi-answer task "a + b within one", three strings)."""
    return {str(a + b + d).encode() for d in range(-tol, tol + 1) if a + b + d >= 0}


def rewards_within(completions: torch.Tensor, pairs: torch.Tensor, tol: int) -> torch.Tensor:
    """1.0 where the completion (B, L), cut at its first END, is one of accepted(a, b, tol); (B,). tol = 0 is
    kernels.rl.task.rewards."""
    return torch.tensor([float(ans in accepted(a, b, tol)) for ans, (a, b) in zip(answers(completions), pairs.tolist())])


def keep_correct(completions: torch.Tensor, pairs: torch.Tensor, group_size: int, *,
                 distinct: bool = True, tol: int = 0) -> list[tuple[int, int, str]]:
    """The verifier as a filter: (a, b, answer) for every accepted completion; completions (P*G, L) are
    G samples of each of P pairs (P*G, 2), in groups. ``distinct`` keeps one copy of each distinct
    accepted answer per prompt (Yuan et al. 2023), else every accepted sample."""
    ok = rewards_within(completions, pairs, tol).bool().tolist()
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
                  temperature: float = 1.0, tol: int = 0, desc: str | None = None) -> dict:
    """n samples for each pair (P, 2), ``chunk`` prompts at a time: per-prompt accepted counts c (P,),
    first accepted sample's index (P,; -1 when none), and the examples (a, b, answer) keep_correct keeps:
    ``kept`` with the distinct filter, ``every`` without."""
    counts, first, kept, every = [], [], [], []
    for s in tqdm(range(0, len(pairs), chunk), desc=desc, disable=desc is None, leave=False):
        p = pairs[s: s + chunk]
        rep = p.repeat_interleave(n, 0)                                              # (chunk*n, 2)
        comp = task.sample(model, rep, temperature=temperature, generator=gen)
        r = rewards_within(comp, rep, tol).view(len(p), n)                          # (chunk, n)
        counts += r.sum(1).long().tolist()
        first += torch.where(r.any(1), r.argmax(1), torch.full((len(p),), -1)).tolist()
        kept += keep_correct(comp, rep, n, tol=tol)
        every += keep_correct(comp, rep, n, distinct=False, tol=tol)
    return {"c": counts, "first": first, "kept": kept, "every": every}


# ---------------------------------------------------------------- pass@k, references

def pass_at_k_exact(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) with exact integers (math.comb), rounded once to float."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k_exact: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    from fractions import Fraction
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def pass_at_k_ref(n: torch.Tensor, c: torch.Tensor, k_max: int) -> torch.Tensor:
    """pass@k for k = 1..k_max of every problem, in float64: (P, k_max). n, c (P,) integer.
    1 - prod_{i=n-c+1}^{n} (1 - k/i), and 1 where n - c < k; needs k_max <= min(n)."""
    if len(n) and k_max > int(n.min()):
        raise ValueError(f"pass_at_k_ref: k_max={k_max} exceeds the smallest n={int(n.min())}")
    n64, c64 = n.double()[:, None], c.double()[:, None]                            # (P, 1)
    k = torch.arange(1, k_max + 1, dtype=torch.float64)[None]                       # (1, K)
    j = torch.arange(int(c.max()) if len(c) else 0, dtype=torch.float64)[None, None]   # (1, 1, J)
    i = n64[..., None] - j                                                           # i = n, n-1, ..., n-c+1
    factor = torch.where(j < c64[..., None], 1 - k[..., None] / i, torch.ones(()))  # (P, K, J)
    out = 1 - factor.prod(-1)
    return torch.where(n64 - c64 < k, torch.ones((), dtype=torch.float64), out)


def pass_at_k_biased(n: torch.Tensor, c: torch.Tensor, k_max: int) -> torch.Tensor:
    """The plug-in estimate 1 - (1 - c/n)^k (with replacement): biased low for k > 1. (P, k_max)."""
    k = torch.arange(1, k_max + 1, dtype=torch.float64)[None]
    return 1 - (1 - c.double()[:, None] / n.double()[:, None]) ** k


# ---------------------------------------------------------------- pass@k, the kernel

@triton.jit
def _pass_at_k_kernel(n_ptr, c_ptr, out_ptr, P, K, J, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                      BIASED: tl.constexpr = False):
    """One program per (block of BLOCK_P problems, block of BLOCK_K values of k): out[p, k-1] = pass@k.
    The product runs over j = 0..J-1 (J = the largest c), a factor (1 - k / (n - j)) where j < c.
    BIASED=True (broken) computes the plug-in 1 - (1 - c/n)^k instead."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)       # problems, int64
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K) + 1                    # k = 1..K
    row_ok, k_ok = rows < P, ks <= K
    n = tl.load(n_ptr + rows, mask=row_ok, other=1).to(tl.float32)[:, None]        # (BLOCK_P, 1)
    c = tl.load(c_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
    k = ks.to(tl.float32)[None, :]                                                 # (1, BLOCK_K)
    if BIASED:
        keep = tl.exp(k * tl.log(1.0 - c / n))                                     # (1 - c/n)^k, with replacement
    else:
        keep = tl.full((BLOCK_P, BLOCK_K), 1.0, tl.float32)                        # C(n-c, k) / C(n, k)
        for j in range(0, J):
            factor = 1.0 - k / (n - j)                                             # i = n - j, i > n - c
            keep *= tl.where(j < c, factor, 1.0)
        keep = tl.where(n - c < k, 0.0, keep)                                      # every k-subset has a correct one
    out = rows[:, None] * K + (ks - 1)[None, :]                                    # int64: P * K may pass 2**31
    tl.store(out_ptr + out, 1.0 - keep, mask=row_ok[:, None] & k_ok[None, :])


GPU_BLOCKS = (32, 32)      # (BLOCK_P, BLOCK_K): 1024 outputs per program, 8 per thread with 4 warps


def _pass_at_k_args(n, c, out, k_max: int, max_c: int, biased: bool, block_p: int = GPU_BLOCKS[0],
                    block_k: int = GPU_BLOCKS[1]):
    """(grid, args, kwargs) of the pass@k launch; shared by :func:`pass_at_k` and :func:`aot_job`."""
    P = n.numel()
    return ((triton.cdiv(P, block_p), triton.cdiv(k_max, block_k)), (n, c, out, P, k_max, max_c),
            dict(BLOCK_P=block_p, BLOCK_K=block_k, BIASED=biased, num_warps=4))


def default_blocks(problems: int, k_max: int) -> tuple[int, int]:
    """The tile: GPU_BLOCKS on a GPU; under the interpreter, where every loop iteration costs a numpy
    call, one tile as large as the problem (up to 1024 x 256) so the loop over j runs once."""
    if runtime.device().type == "cuda":
        return GPU_BLOCKS
    return min(1024, triton.next_power_of_2(problems)), min(256, triton.next_power_of_2(k_max))


def pass_at_k(n: torch.Tensor, c: torch.Tensor, k_max: int, *, biased: bool = False,
              blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`pass_at_k_ref` as a Triton kernel: pass@k for k = 1..k_max of P problems, float32 (P, k_max).
    n, c (P,) integer tensors on the kernels' device, 0 <= c <= n, k_max <= min(n). ``blocks`` =
    (BLOCK_P, BLOCK_K), powers of two (default :func:`default_blocks`). ``biased=True`` is broken."""
    for name, t in (("n", n), ("c", c)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"pass_at_k: {name} must be a 1-D int32 or int64 tensor")
        if t.device.type != runtime.device().type:
            raise ValueError(f"pass_at_k: {name} is on {t.device}; kernels run on {runtime.device()}")
    if n.shape != c.shape:
        raise ValueError(f"pass_at_k: n and c must have the same shape, got {tuple(n.shape)} and {tuple(c.shape)}")
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"pass_at_k: k_max must be a positive int, got {k_max!r}")
    out = torch.empty(n.numel(), k_max, dtype=torch.float32, device=n.device)
    if n.numel() == 0:
        return out
    if bool((c < 0).any()) or bool((c > n).any()):
        raise ValueError("pass_at_k: need 0 <= c <= n for every problem")
    if k_max > int(n.min()):
        raise ValueError(f"pass_at_k: k_max={k_max} exceeds the smallest n={int(n.min())} (pass@k needs k <= n)")
    blocks = default_blocks(n.numel(), k_max) if blocks is None else tuple(blocks)
    if len(blocks) != 2 or any(not isinstance(b, int) or b < 1 or b & (b - 1) for b in blocks):
        raise ValueError(f"pass_at_k: blocks must be two powers of two (BLOCK_P, BLOCK_K), got {blocks!r}")
    grid, args, kwargs = _pass_at_k_args(n.contiguous(), c.contiguous(), out, k_max, int(c.max()), biased, *blocks)
    _pass_at_k_kernel[grid](*args, **kwargs)
    return out


def aot_job(problems: int = 164, n: int = 200, k_max: int = 100):
    """The launch :func:`pass_at_k` makes for ``problems`` problems of n samples, k = 1..k_max, from meta
    tensors (:func:`kernels.inspect.launch_job`). Defaults: HumanEval's 164 problems, 200 samples, k <= 100
    (Chen et al. 2021)."""
    from kernels import inspect as ki

    nt = torch.empty(problems, dtype=torch.int64, device="meta")
    grid, args, kwargs = _pass_at_k_args(nt, torch.empty_like(nt), torch.empty(problems, k_max, device="meta"),
                                         k_max, n, False)
    return ki.launch_job(_pass_at_k_kernel, *args, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """HumanEval's pass@k table (164 x 200 samples, k <= 100) and a large sweep (100,000 problems, n = 256)."""
    return {"pass@k, 164 problems, n=200, k<=100": aot_job(164, 200, 100),
            "pass@k, 100000 problems, n=256, k<=256": aot_job(100_000, 256, 256)}


# ---------------------------------------------------------------- the run

def finetune(model, examples: list[tuple[int, int, str]], *, steps: int, lr: float, gen: torch.Generator,
             examples_per_step: int = 96, desc: str | None = None) -> list[float]:
    """kernels.rl.sft's training path (packed, prompt-masked) on ``examples`` (a, b, answer): accepted samples
    or reference answers; warm-up 20 steps, cosine to lr/10. Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    losses = []
    for step in tqdm(range(steps), desc=desc, disable=desc is None, leave=False):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, max_lr=lr, min_lr=lr / 10, warmup=20, total=steps)
        pick = torch.randint(0, len(examples), (examples_per_step,), generator=gen).tolist()
        b = sft.pack([sft.example(*examples[i][:2], answer=examples[i][2]) for i in pick], model.config.block_size)
        loss = sft.masked_loss(sft.packed_forward(model, b["ids"], b["positions"], sft.packed_mask(b["seq"])),
                               b["targets"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


SEEDS = (0, 1, 2)


def _seeded_start(seed: int, train_prompts: int, eval_prompts: int, threads: int = 1):
    """What every run starts from: the seed, the SFT model, the first ``train_prompts`` training prompts and
    the first ``eval_prompts`` held-out ones."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    base = sft.load_sft()
    train_pairs, held_out = task.split_pairs()
    return base, train_pairs[:train_prompts], held_out[:eval_prompts]


def run(out_dir: Path | None, *, tol: int = 1, train_prompts: int = 600, k: int = 8, eval_prompts: int = 100,
        n_eval: int = 32, steps: int = 60, lr: float = 3e-4, seed: int = 0, threads: int = 1, progress: bool = True,
        stop_after_collect: int | None = None) -> dict:
    """One seed of the committed run (see the module docstring); writes out_dir/seed{seed}.json.
    ``stop_after_collect`` samples only that many training prompts and returns (a slice for the test)."""
    start = time.perf_counter()
    base, pool, held_out = _seeded_start(seed, train_prompts, eval_prompts, threads)
    gen = torch.Generator().manual_seed(seed)
    collect = sample_groups(base, pool[:stop_after_collect] if stop_after_collect else pool, k, gen, tol=tol,
                            desc="sample train prompts" if progress else None)
    if stop_after_collect:
        return collect
    assert all(ans.encode() in accepted(a, b, tol) for a, b, ans in collect["kept"])
    distinct = collect["kept"]
    every = collect["every"]                  # every accepted sample: each string as often as it was sampled
    reference = [(a, b, str(a + b)) for a, b in pool.tolist()]         # the same prompts, reference answers
    arms = {"sft": None, "rft": distinct, "rft_every_correct": every, "sft_more": reference}
    results = {}
    for name, data in arms.items():
        model = base if data is None else copy.deepcopy(base)
        losses = []
        if data is not None:
            losses = finetune(model, data, steps=steps, lr=lr, gen=torch.Generator().manual_seed(seed + 1),
                              desc=f"fine-tune {name}" if progress else None)
        model.eval()
        ev = sample_groups(model, held_out, n_eval, torch.Generator().manual_seed(seed + 2), tol=tol,
                           desc=f"sample held-out ({name})" if progress else None)
        results[name] = {"examples": 0 if data is None else len(data),
                         "loss_first": round(losses[0], 4) if losses else None,
                         "loss_last": round(losses[-1], 4) if losses else None,
                         "c": ev["c"], "first": ev["first"],
                         "distinct_per_prompt": _distinct_per_prompt(ev["kept"], held_out)}
    meta = {"tol": tol, "train_prompts": train_prompts, "k": k, "eval_prompts": eval_prompts, "n_eval": n_eval,
            "steps": steps, "lr": lr, "examples_per_step": 96, "temperature": 1.0, "seed": seed, "threads": threads,
            "collect": {"c": collect["c"], "first": collect["first"], "kept_distinct": len(distinct),
                        "kept_every": len(every), "rollouts": train_prompts * k,
                        "distinct_per_prompt": _distinct_per_prompt(distinct, pool)},
            "models": results, "seconds": round(time.perf_counter() - start, 1),
            "torch": torch.__version__, "command": f"python -m kernels.rl.rft --seeds {seed}"}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"seed{seed}.json").write_text(json.dumps(meta) + "\n")
    return meta


def second_round(out_dir: Path | None, *, tol: int = 1, train_prompts: int = 600, k: int = 8, eval_prompts: int = 100,
                 n_eval: int = 32, steps: int = 60, lr: float = 3e-4, seed: int = 0, progress: bool = True,
                 stop_after_collect: int | None = None) -> dict:
    """One more round of the loop (STaR, ReST-EM): rebuild :func:`run`'s ``rft`` model (same seed: the same
    samples and batches, so its held-out counts must equal the stored ones), sample the same training prompts
    from it, keep the distinct accepted strings, fine-tune the SFT model on them (both papers restart each
    round from the base model) and evaluate as :func:`run` does. Writes out_dir/seed{seed}-round2.json.
    ``stop_after_collect`` builds the round-1 model, samples only that many training prompts from it and returns
    that collection (a slice for the test)."""
    start = time.perf_counter()
    base, pool, held_out = _seeded_start(seed, train_prompts, eval_prompts)
    kept = sample_groups(base, pool, k, torch.Generator().manual_seed(seed), tol=tol)["kept"]
    results, sampler = {}, None
    for name, gen_seed in (("rft", seed), ("rft_round2", seed + 3)):
        if sampler is not None:                                           # round 2: the round-1 model samples
            col = sample_groups(sampler, pool[:stop_after_collect] if stop_after_collect else pool, k,
                                torch.Generator().manual_seed(gen_seed), tol=tol)
            if stop_after_collect:
                return col
            kept = col["kept"]
            results["collect"] = {"c": col["c"], "kept_distinct": len(kept), "kept_every": len(col["every"]),
                                  "distinct_per_prompt": _distinct_per_prompt(kept, pool)}
        model = copy.deepcopy(base)
        finetune(model, kept, steps=steps, lr=lr, gen=torch.Generator().manual_seed(seed + 1),
                 desc=f"fine-tune {name}" if progress else None)
        model.eval()
        if stop_after_collect:                                            # the test needs only the round-1 model
            sampler = model
            continue
        ev = sample_groups(model, held_out, n_eval, torch.Generator().manual_seed(seed + 2), tol=tol)
        results[name] = {"examples": len(kept), "c": ev["c"], "first": ev["first"],
                         "distinct_per_prompt": _distinct_per_prompt(ev["kept"], held_out)}
        sampler = model
    meta = {"seed": seed, "tol": tol, "train_prompts": train_prompts, "k": k, "steps": steps, "lr": lr,
            **results, "seconds": round(time.perf_counter() - start, 1),
            "command": f"python -m kernels.rl.rft --round2 --seeds {seed}"}
    if out_dir is not None:
        (out_dir / f"seed{seed}-round2.json").write_text(json.dumps(meta) + "\n")
    return meta


TEMPERATURES = (0.7, 1.3)


def collect_temperature(out_dir: Path | None, *, temperatures=TEMPERATURES, tol: int = 1, train_prompts: int = 600,
                        k: int = 8, eval_prompts: int = 100, n_eval: int = 32, steps: int = 60, lr: float = 3e-4,
                        seed: int = 0, progress: bool = True) -> dict:
    """The sampling temperature of the collection as a knob: :func:`run`'s ``rft`` arm with the training prompts
    sampled at each of ``temperatures`` instead of 1 (Yuan et al. sample at 0.7); fine-tuning and evaluation
    (at temperature 1) as in :func:`run`. Writes out_dir/seed{seed}-temperature.json."""
    start = time.perf_counter()
    base, pool, held_out = _seeded_start(seed, train_prompts, eval_prompts)
    results = {}
    for t in temperatures:
        col = sample_groups(base, pool, k, torch.Generator().manual_seed(seed), tol=tol, temperature=t)
        model = copy.deepcopy(base)
        finetune(model, col["kept"], steps=steps, lr=lr, gen=torch.Generator().manual_seed(seed + 1),
                 desc=f"fine-tune rft, collected at T={t}" if progress else None)
        model.eval()
        ev = sample_groups(model, held_out, n_eval, torch.Generator().manual_seed(seed + 2), tol=tol)
        results[str(t)] = {"collect": {"c": col["c"], "kept_distinct": len(col["kept"]), "kept_every": len(col["every"]),
                                       "distinct_per_prompt": _distinct_per_prompt(col["kept"], pool)},
                           "c": ev["c"], "first": ev["first"],
                           "distinct_per_prompt": _distinct_per_prompt(ev["kept"], held_out)}
    meta = {"seed": seed, "tol": tol, "train_prompts": train_prompts, "k": k, "steps": steps, "lr": lr,
            "temperatures": list(temperatures), "runs": results, "seconds": round(time.perf_counter() - start, 1),
            "command": f"python -m kernels.rl.rft --temperature --seeds {seed}"}
    if out_dir is not None:
        (out_dir / f"seed{seed}-temperature.json").write_text(json.dumps(meta) + "\n")
    return meta


def _distinct_per_prompt(kept: list[tuple[int, int, str]], pairs: torch.Tensor) -> list[int]:
    """How many distinct accepted answers each of ``pairs`` (P, 2) has among ``kept`` (distinct-filtered)."""
    n = {}
    for a, b, _ in kept:
        n[(a, b)] = n.get((a, b), 0) + 1
    return [n.get((a, b), 0) for a, b in pairs.tolist()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.rl.rft", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    p.add_argument("--round2", action="store_true", help="one more round from each seed's RFT model (second_round)")
    p.add_argument("--temperature", action="store_true", help="the rft arm collected at TEMPERATURES")
    args = p.parse_args(argv)
    for seed in args.seeds if args.temperature else ():
        meta = collect_temperature(args.out, seed=seed)
        print(seed, {t: sum(r["c"]) for t, r in meta["runs"].items()}, meta["seconds"])
    if args.temperature:
        return 0
    for seed in args.seeds if args.round2 else ():
        meta = second_round(args.out, seed=seed)
        print(seed, {m: sum(meta[m]["c"]) for m in ("rft", "rft_round2")}, meta["seconds"])
    for seed in () if args.round2 else args.seeds:
        meta = run(args.out, seed=seed)
        print(seed, {m: sum(r["c"]) for m, r in meta["models"].items()}, meta["seconds"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
