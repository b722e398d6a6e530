"""A model that retrieves, so KV eviction has something to lose: multi-needle recall on the course's GPT.

The tiny GPT of ``kernels.model`` predicts bytes of text from the last few bytes and cannot copy, so
no eviction policy can hurt it much (book/08-kv-cache/kv-eviction.ipynb). This module trains three
small GPTs (the same ``kernels.model.gpt.GPT``: RoPE, grouped-query attention, SwiGLU; three seeds)
on a task that can only be solved by reading one early token, and scores the policies of
``kernels.kvcache.eviction`` on it through the same ``compressed_forward``.

The task (multi-query associative recall, MQAR, in its passkey form): a context of ``CONTEXT`` tokens
of random filler hides ``NEEDLES`` facts at random positions, one token each. A fact binds a key
(one of ``KEYS``) to a value (one of ``VALUES``): fact token = FACT0 + key * VALUES + value, and the
keys of one context are distinct. After the context, the question list names the keys of ``ASKED``
of the facts (one key token each), and the answer block asks them again, one at a time: the key,
then the fact it binds. The model must predict the fact at each key of the answer block, which it
can only take from the context (the question list holds keys, not facts; earlier answers are other
facts). Layout, T = CONTEXT + 3 * ASKED tokens:

    context (64): filler and 12 facts | question list (8): k_a k_b ... | answer block (16): k_a f_a k_b f_b ...

Scored: the ASKED answers (the prediction at each key of the answer block). A model that knows the key
but not the context gets 1 / VALUES (the fact's key is given by the question; its value is not).

Two cuts of the same sequence give the two settings of an evicting cache:

* "question in the prompt" (prompt = context + question list, P = 72): the prompt's last tokens are
  the questions, as in document question answering, so SnapKV's observation window holds them; the
  cache is cut after them.
* "question after the cut" (prompt = context, P = 64): the cache is cut before the questions arrive,
  as in a multi-turn conversation whose later turn asks about something early; no policy can know
  which facts will be asked.

Why a fact is one token: the answer is then a copy of one context token, which two layers learn in
a few hundred steps (the loss is about 0.1 at step 250 and below 0.03 at step 300, metrics.json). With a key token followed by a value token (Zoology's layout) the model has to learn
an induction-style two-step lookup first; in the trials that chose this layout it stayed near a
quarter of the answers after 1500 steps, beyond a few CPU-minutes.

Training: ``python -m kernels.kvcache.recall`` (``make kv-recall``) trains the three seeds, 400 steps
each (about a minute on one core), and writes models/kv-recall/{seed0,seed1,seed2}.pt,
config.json and metrics.json. Notebooks load the committed weights; they never retrain.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kernels.kvcache import eviction as ev
from kernels.model.gpt import GPT, GPTConfig
from kernels.model.train import lr_at, param_groups, train_step

FILLER, KEYS, VALUES = 16, 16, 16          # token ids: filler 0..15, keys 16..31, facts 32..287
KEY0 = FILLER
FACT0 = FILLER + KEYS
CONTEXT, NEEDLES, ASKED = 64, 12, 8
T = CONTEXT + 3 * ASKED                      # context, question list, answer block (key, fact) * ASKED
CUTS = {"question in the prompt": CONTEXT + ASKED, "question after the cut": CONTEXT}
CONFIG = GPTConfig(vocab_size=FACT0 + KEYS * VALUES, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                   d_model=64, d_ff=128)
TRAIN = dict(steps=400, batch_size=32, max_lr=3e-3, min_lr=3e-4, warmup=50, weight_decay=0.1)
SEEDS = (0, 1, 2)
EVAL_SEED = 10_000                           # held-out prompts: a generator no training run uses
MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "kv-recall"


def answer_positions() -> torch.Tensor:
    """Positions (ASKED,) of the answer block's keys: the rows whose prediction is scored."""
    return CONTEXT + ASKED + 2 * torch.arange(ASKED)


def recall_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n sequences of the task. Returns tokens (n, T) int64, targets (n, T) (the fact at each scored row,
    -100 elsewhere) and the context position of the fact each answer needs, needle_pos (n, ASKED)."""
    if n < 1:
        raise ValueError(f"recall_batch: n must be >= 1, got {n}")
    x = torch.randint(0, FILLER, (n, T), generator=generator)                       # filler everywhere
    keys = torch.rand(n, KEYS, generator=generator).argsort(-1)[:, :NEEDLES]        # (n, NEEDLES) distinct
    values = torch.randint(0, VALUES, (n, NEEDLES), generator=generator)
    pos = torch.rand(n, CONTEXT, generator=generator).argsort(-1)[:, :NEEDLES]      # (n, NEEDLES) distinct
    rows = torch.arange(n)[:, None]
    x[rows, pos] = FACT0 + keys * VALUES + values                                    # the needles
    ask = torch.rand(n, NEEDLES, generator=generator).argsort(-1)[:, :ASKED]        # which facts are asked
    asked_keys, asked_facts = KEY0 + keys.gather(1, ask), x[rows, pos.gather(1, ask)]
    x[:, CONTEXT:CONTEXT + ASKED] = asked_keys                                       # the question list
    ans = answer_positions()
    x[:, ans], x[:, ans + 1] = asked_keys, asked_facts                               # the answer block
    y = torch.full((n, T), -100)
    y[:, ans] = asked_facts                                                          # predicted at the key
    return x, y, pos.gather(1, ask)


def lookup_answers(x: torch.Tensor) -> torch.Tensor:
    """The task solved by reading it: for each key of the answer block, the context's fact with that key.
    x (n, T) -> (n, ASKED) fact tokens (-1 where no fact has the key)."""
    context = x[:, :CONTEXT]                                                         # (n, CONTEXT)
    is_fact = context >= FACT0
    fact_key = torch.where(is_fact, (context - FACT0) // VALUES, -1)                 # (n, CONTEXT)
    asked = x[:, answer_positions()] - KEY0                                          # (n, ASKED)
    match = fact_key[:, None, :] == asked[:, :, None]                                # (n, ASKED, CONTEXT)
    return torch.where(match.any(-1), (context[:, None, :] * match).sum(-1), -1)


# ---------------------------------------------------------------- training

def train(seed: int, *, steps: int = TRAIN["steps"], progress: bool = True) -> tuple[GPT, list[float]]:
    """One model: AdamW with the tiny GPT's recipe (warm-up, cosine decay, clipping at 1) on fresh
    batches of the task; the loss is the cross-entropy of the scored rows only. Returns the model
    (eval mode) and the loss of every step."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(param_groups(model, TRAIN["weight_decay"]), lr=TRAIN["max_lr"], betas=(0.9, 0.95))
    losses = []
    for step in tqdm(range(steps), desc=f"kv-recall seed {seed}", unit="step", disable=not progress):
        lr = lr_at(step, max_lr=TRAIN["max_lr"], min_lr=TRAIN["min_lr"], warmup=TRAIN["warmup"], total=TRAIN["steps"])
        for group in opt.param_groups:
            group["lr"] = lr
        x, y, _ = recall_batch(TRAIN["batch_size"], gen)
        losses.append(train_step(model, opt, x, y).item())                       # -100 rows ignored
    return model.eval(), losses


def load(seed: int, directory: Path | str = MODEL_DIR) -> GPT:
    """The committed model of one seed, in eval mode, fp32, on the CPU."""
    directory = Path(directory)
    model = GPT(GPTConfig.from_json((directory / "config.json").read_text()))
    model.load_state_dict(torch.load(directory / f"seed{seed}.pt", map_location="cpu", weights_only=True))
    return model.eval()


def metrics(directory: Path | str = MODEL_DIR) -> dict:
    return json.loads((Path(directory) / "metrics.json").read_text())


# ---------------------------------------------------------------- scoring a policy

def held_out(n: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n prompts no training run saw (their own generator)."""
    return recall_batch(n, torch.Generator().manual_seed(EVAL_SEED))


def recall(model: GPT, x: torch.Tensor, needle_pos: torch.Tensor, prompt_len: int, policy: str = "full",
           budget: int | None = None, **options) -> dict[str, torch.Tensor]:
    """Score one policy: the prompt's cache cut to ``budget`` tokens per layer and K/V head by ``policy``
    (``ev.compressed_forward``: prefill in full, then decode against the kept prompt tokens and every decoded
    one). x (n, T) from :func:`recall_batch`, needle_pos (n, ASKED) its third output. Returns (n, ASKED) bools:
    "correct" (the fact predicted at the answer's key), "kept" (the needle is among the prompt tokens every
    layer and K/V head reads for that answer) and "lost" (no layer or K/V head reads it)."""
    if prompt_len not in CUTS.values():
        raise ValueError(f"recall: prompt_len must be one of {sorted(CUTS.values())}, got {prompt_len}")
    if x.shape[1:] != (T,) or needle_pos.shape != (x.shape[0], ASKED):
        raise ValueError(f"recall: x (n, {T}) and needle_pos (n, {ASKED}) expected, got {tuple(x.shape)}, "
                         f"{tuple(needle_pos.shape)}")
    logits, kept, _ = ev.compressed_forward(model, x, prompt_len, policy, budget, **options)
    ans = answer_positions()
    reads = []                                                                         # per layer (n, Hkv, ASKED)
    for kp in kept:
        if kp.dim() == 3:                                                              # evicted once: (n, Hkv, budget)
            kp = kp[:, :, None, :].expand(-1, -1, ASKED, -1)
        else:                                                                          # per query: (n, Hkv, T - P, budget)
            kp = kp[:, :, ans - prompt_len]
        reads.append((kp == needle_pos[:, None, :, None]).any(-1))
    reads = torch.stack(reads)                                                         # (layers, n, Hkv, ASKED)
    return {"correct": logits[:, ans].argmax(-1) == x[:, ans + 1],
            "kept": reads.all(2).all(0), "lost": ~reads.any(2).any(0)}


def grid(models: list[GPT], x: torch.Tensor, needle_pos: torch.Tensor, policies, budgets,
         **options) -> dict[tuple[str, str, int | None], list[dict[str, torch.Tensor]]]:
    """:func:`recall` of every model (one per seed) at both cuts, for "full" (budget None) and every policy at
    every budget: {(cut, policy, budget): [result of each model]}."""
    out = {}
    for cut, P in CUTS.items():
        out[cut, "full", None] = [recall(m, x, needle_pos, P) for m in models]
        for policy in policies:
            for b in budgets:
                out[cut, policy, b] = [recall(m, x, needle_pos, P, policy, b, **options) for m in models]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.kvcache.recall", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=MODEL_DIR)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(CONFIG.to_json() + "\n")
    x, _, needle_pos = held_out()
    runs = {}
    for seed in SEEDS:
        start = time.perf_counter()
        model, losses = train(seed)
        seconds = time.perf_counter() - start
        torch.save(model.state_dict(), args.out / f"seed{seed}.pt")
        acc = {cut: recall(model, x, needle_pos, P)["correct"].float().mean().item() for cut, P in CUTS.items()}
        runs[str(seed)] = {"train_seconds": round(seconds, 1), "first_losses": [round(v, 5) for v in losses[:20]],
                           "loss_every_50_steps": [round(v, 4) for v in losses[::50]],
                           "final_loss": round(sum(losses[-20:]) / 20, 5), "full_cache_accuracy": acc}
        print(f"seed {seed}: full-cache accuracy {acc}, {seconds:.0f} s")
    info = {"task": dict(filler=FILLER, keys=KEYS, values=VALUES, context=CONTEXT, needles=NEEDLES, asked=ASKED),
            "train": TRAIN, "seeds": runs, "held_out": {"sequences": len(x), "seed": EVAL_SEED},
            "threads": 1, "torch": torch.__version__, "command": "python -m kernels.kvcache.recall"}
    (args.out / "metrics.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
