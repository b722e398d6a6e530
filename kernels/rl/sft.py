"""Supervised fine-tuning: a conversation as a training signal (loss mask, packing), and the SFT run.

A rendered conversation (kernels.rl.task.render) is one token sequence; training on it is next-token
prediction with one change: the targets inside the user's turn are set to IGNORE, so the loss is the
mean negative log-likelihood of the assistant's tokens only,

    L = - sum_t m_t log pi(x_{t+1} | x_{<=t}) / sum_t m_t,     m_t = 1 iff x_{t+1} is an assistant token.

Packing puts several short conversations into one row of ``block_size`` tokens. For it to train
each conversation exactly as if it were alone, a token may attend only to earlier tokens *of its
own conversation* (a block-diagonal causal mask), and each conversation's positions restart at 0.

``python -m kernels.rl.sft`` fine-tunes models/tiny-gpt on the addition task and writes
models/rl/sft/ (checkpoint in fp16, log.csv, metrics.json); ``--no-mask`` trains the same run
without the loss mask into models/rl/sft-nomask/ (log and metrics only). ``--control`` runs the
mask experiment's control (:func:`control_runs`): masked, unmasked, and unmasked with the loss
divided by the number of answer targets, at three seeds each, into models/rl/sft-control/runs.json.
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kernels.model.gpt import GPT, add_rms_norm_torch, load_pretrained, rope, swiglu_torch
from kernels.model.train import lr_at
from kernels.rl import task

IGNORE = -100
ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "models" / "rl"


def example(a: int, b: int, *, mask_prompt: bool = True, answer: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs x (L,), targets y (L,)) of one rendered conversation, y_t = x_{t+1}, answering ``answer``
    (default: the sum); with ``mask_prompt`` the targets that are still the user's turn (and the assistant
    marker) are IGNORE."""
    ids = torch.tensor(task.render(a, b, str(a + b) if answer is None else answer))
    x, y = ids[:-1], ids[1:].clone()
    if mask_prompt:
        y[: task.PROMPT_LEN - 1] = IGNORE        # targets 1..PROMPT_LEN-1 are the prompt's own bytes
    return x, y


def multi_turn_example(pairs: list[tuple[int, int]], *, mask_prompt: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(x (L,), y (L,)) of a conversation of several turns, one addition per turn, rendered one after
    the other. With ``mask_prompt`` every target that is not an assistant byte (answer or END) is
    IGNORE: the user's turns, the assistant markers, and the USER byte that follows an END. One turn
    gives :func:`example`."""
    ids, assistant = [], []
    for a, b in pairs:
        turn = task.render(a, b, str(a + b))
        ids += turn
        assistant += [False] * task.PROMPT_LEN + [True] * (len(turn) - task.PROMPT_LEN)
    ids, assistant = torch.tensor(ids), torch.tensor(assistant)
    x, y = ids[:-1], ids[1:].clone()
    if mask_prompt:
        y[~assistant[1:]] = IGNORE
    return x, y


def pack(examples: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> dict[str, torch.Tensor]:
    """Pack examples greedily into rows of ``block_size`` tokens. Returns ids, targets, positions
    (restarting at 0 per example) and seq (an example's number within its row; -1 on padding), each (R, T)."""
    packed, row, used = [], [], 0
    for x, y in examples:
        if len(x) > block_size:
            raise ValueError(f"pack: an example of {len(x)} tokens exceeds block_size={block_size}")
        if used + len(x) > block_size:
            packed.append(row)
            row, used = [], 0
        row.append((x, y))
        used += len(x)
    if row:
        packed.append(row)
    R = len(packed)
    out = {"ids": torch.zeros(R, block_size, dtype=torch.long),
           "targets": torch.full((R, block_size), IGNORE, dtype=torch.long),
           "positions": torch.zeros(R, block_size, dtype=torch.long),
           "seq": torch.full((R, block_size), -1, dtype=torch.long)}
    for r, items in enumerate(packed):
        at = 0
        for k, (x, y) in enumerate(items):
            n = len(x)
            out["ids"][r, at: at + n], out["targets"][r, at: at + n] = x, y
            out["positions"][r, at: at + n] = torch.arange(n)
            out["seq"][r, at: at + n] = k
            at += n
    return out


def packed_mask(seq: torch.Tensor) -> torch.Tensor:
    """(R, T, T) boolean: query i may see key j iff j <= i and both belong to the same example."""
    T = seq.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return causal & (seq[:, :, None] == seq[:, None, :])


def cu_seqlens(seq: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The packed batch as a variable-length (varlen) attention kernel takes it: the rows flattened,
    padding (seq = -1) dropped, and the boundaries of the examples as cumulative lengths, int32
    (examples + 1,) starting at 0, with the longest example's length."""
    lengths = [int((row == k).sum()) for row in seq for k in range(int(row.max()) + 1)]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu, max(lengths)


def packed_forward(model: GPT, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The tiny GPT's forward (pure PyTorch path) with explicit positions (R, T) and attention mask
    (R, T, T): logits (R, T, V). With positions = arange and a causal mask it is ``model(ids)``."""
    cfg = model.config
    R, T = ids.shape
    Hq, Hkv, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    x = model.wte(ids)                                                     # (R, T, C)
    for blk in model.blocks:
        u = blk.norm1(x)
        att = blk.attn
        q = rope(att.wq(u).view(R, T, Hq, D).transpose(1, 2), positions, cfg.rope_theta)   # (R, Hq, T, D)
        k = rope(att.wk(u).view(R, T, Hkv, D).transpose(1, 2), positions, cfg.rope_theta)  # (R, Hkv, T, D)
        v = att.wv(u).view(R, T, Hkv, D).transpose(1, 2)
        k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)                  # (R, Hq, T, T)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        a = att.wo((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(R, T, Hq * D))
        h, hn = add_rms_norm_torch(x, a, blk.norm2.weight, cfg.norm_eps)
        x = h + blk.mlp.w_down(swiglu_torch(blk.mlp.w_gate(hn), blk.mlp.w_up(hn)))
    return model.norm_f(x) @ model.wte.weight.T


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets that are not IGNORE."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def answer_normalised_loss(logits: torch.Tensor, targets: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over every scored target (prompt and answer), divided by the number of
    *answer* targets: each answer token gets the weight 1 / N_answer it gets in the masked loss,
    and the prompt's tokens are added on top. With the prompt masked it equals :func:`masked_loss`."""
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return total / (answer != IGNORE).sum()


def answer_targets(targets_masked: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The masked targets (answer tokens only), for measuring the answer loss of any run."""
    return torch.where(targets_masked == IGNORE, torch.full_like(targets, IGNORE), targets)


def batch(pairs: torch.Tensor, n: int, gen: torch.Generator, block_size: int, mask_prompt: bool) -> dict:
    """n random training conversations, packed; ``answer`` holds the answer-only targets of the same rows."""
    pick = pairs[torch.randint(0, len(pairs), (n,), generator=gen)].tolist()
    b = pack([example(a, c, mask_prompt=mask_prompt) for a, c in pick], block_size)
    b["answer"] = pack([example(a, c) for a, c in pick], block_size)["targets"]
    return b


def train_sft(out_dir: Path | None, *, steps: int = 800, examples_per_step: int = 96, lr: float = 1e-3,
              mask_prompt: bool = True, norm: str = "tokens", eval_every: int = 25, seed: int = 0,
              threads: int = 1, progress: bool = True, stop_after: int | None = None) -> dict:
    """Fine-tune the pretrained tiny GPT on packed addition conversations; returns {"log": rows, "model": GPT}.
    ``norm`` is what the loss divides by: "tokens", the scored targets (:func:`masked_loss`), or
    "answer", the answer targets (:func:`answer_normalised_loss`; differs only without the mask).
    Writes log.csv, metrics.json (and, for the masked run, model.pt in fp16) to ``out_dir`` when given.
    ``stop_after`` ends the run early (the schedule still assumes ``steps``): a few steps to check a log."""
    if norm not in ("tokens", "answer"):
        raise ValueError(f"train_sft: norm must be 'tokens' or 'answer', got {norm!r}")
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    model = load_pretrained().train()
    train_pairs, held_out = task.split_pairs()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    log = [{"step": 0, "loss": "", "answer_loss": "", "held_out_accuracy": task.accuracy(model, held_out)}]
    start = time.perf_counter()
    bar = tqdm(range(1, (stop_after or steps) + 1), desc=f"sft ({'masked' if mask_prompt else 'no mask'})", disable=not progress)
    for step in bar:
        for group in opt.param_groups:   # warm-up over 50 steps, then cosine to lr / 10 (kernels.model.train.lr_at)
            group["lr"] = lr_at(step - 1, max_lr=lr, min_lr=lr / 10, warmup=50, total=steps)
        b = batch(train_pairs, examples_per_step, gen, model.config.block_size, mask_prompt)
        logits = packed_forward(model, b["ids"], b["positions"], packed_mask(b["seq"]))
        loss = (masked_loss(logits, b["targets"]) if norm == "tokens"
                else answer_normalised_loss(logits, b["targets"], b["answer"]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        row = {"step": step, "loss": round(loss.item(), 5),
               "answer_loss": round(masked_loss(logits.detach(), b["answer"]).item(), 5), "held_out_accuracy": ""}
        if step % eval_every == 0 or step == steps:
            row["held_out_accuracy"] = task.accuracy(model, held_out)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['held_out_accuracy']:.2f}")
        log.append(row)
    model.eval()
    if out_dir is not None:
        save_run(out_dir, model, log, {
            "steps": steps, "examples_per_step": examples_per_step, "lr": lr, "mask_prompt": mask_prompt,
            "seed": seed, "threads": threads, "train_seconds": round(time.perf_counter() - start, 1),
            "torch": torch.__version__,
            "command": "python -m kernels.rl.sft" + ("" if mask_prompt else " --no-mask")},
            checkpoint=mask_prompt)
    return {"log": log, "model": model}


def save_run(out_dir: Path, model: GPT, log: list[dict], meta: dict, *, checkpoint: bool) -> None:
    """log.csv, metrics.json (meta + final held-out accuracy) and optionally model.pt (fp16)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(log[0]))
        writer.writeheader()
        writer.writerows(log)
    if checkpoint:
        # fp16 halves the committed file; the RL chapters load it back to fp32 (load_sft), and the
        # recorded accuracy is that of the rounded weights.
        torch.save({k: v.half() for k, v in model.state_dict().items()}, out_dir / "model.pt")
        model.load_state_dict({k: v.float() for k, v in torch.load(out_dir / "model.pt").items()})
    _, held_out = task.split_pairs()
    meta = dict(meta, held_out_accuracy=task.accuracy(model, held_out))
    (out_dir / "metrics.json").write_text(json.dumps(meta, indent=2) + "\n")


@torch.no_grad()
def held_out_answer_nll(model: GPT, pairs: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats) of the answer tokens of ``pairs``, teacher-forced: a
    continuous score of how well the answers are learned, less noisy than greedy accuracy."""
    b = pack([example(a, c) for a, c in pairs.tolist()], model.config.block_size)
    logits = packed_forward(model, b["ids"], b["positions"], packed_mask(b["seq"]))
    return float(masked_loss(logits, b["targets"]))


CONTROL_ARMS = {"masked": dict(mask_prompt=True, norm="tokens"),
                "unmasked": dict(mask_prompt=False, norm="tokens"),
                "unmasked, answer-normalised": dict(mask_prompt=False, norm="answer")}
CONTROL_RUN = dict(steps=150, examples_per_step=32)


def control_runs(seeds: tuple[int, ...] = (0, 1, 2), arms: tuple[str, ...] = tuple(CONTROL_ARMS),
                 threads: int = 1) -> dict:
    """The mask experiment with its control, much shorter than the main run (CONTROL_RUN: 150 steps of
    32 conversations, a sixteenth of its conversations) so that nine runs take minutes on one core. Per run: the final held-out greedy accuracy, the
    held-out answer NLL, and the mean training answer loss of the last 50 steps. Each run is seeded
    and single-threaded, so runs of a subset of ``arms`` (in parallel processes) give the same numbers."""
    start = time.perf_counter()
    _, held_out = task.split_pairs()
    runs = []
    for arm in arms:
        for seed in seeds:
            out = train_sft(None, **CONTROL_RUN, **CONTROL_ARMS[arm], seed=seed, threads=threads, eval_every=10**9, progress=False)
            log = out["log"]
            runs.append({"arm": arm, "seed": seed, "held_out_accuracy": log[-1]["held_out_accuracy"],
                         "held_out_answer_nll": round(held_out_answer_nll(out["model"], held_out), 5),
                         "train_answer_loss_last50": round(sum(r["answer_loss"] for r in log[-50:]) / 50, 5),
                         "first_losses": [r["loss"] for r in log[1:4]]})
    return {**CONTROL_RUN, "lr": 1e-3, "seeds": list(seeds), "threads": threads, "torch": torch.__version__,
            "seconds": round(time.perf_counter() - start, 1), "command": "python -m kernels.rl.sft --control",
            "runs": runs}


def load_sft(directory: Path = OUT_DIR / "sft") -> GPT:
    """The committed SFT checkpoint (fp16 on disk) as an fp32 tiny GPT in eval mode."""
    model = load_pretrained()
    model.load_state_dict({k: v.float() for k, v in torch.load(Path(directory) / "model.pt").items()})
    return model.eval()


def policy_and_reference(seed: int, threads: int = 1) -> tuple[GPT, GPT]:
    """The start of every run after SFT (PPO, GRPO, DAPO, DPO, online DPO): seed torch, set the threads,
    and load the SFT checkpoint twice: the policy to train (train mode) and its frozen copy, the
    reference of the KL penalty and of the preference losses."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    policy = load_sft().train()
    return policy, copy.deepcopy(policy).eval()


def adamw(params, lr: float) -> torch.optim.AdamW:
    """The optimiser of every run after SFT: AdamW, betas (0.9, 0.95), no weight decay."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def read_log(path: Path) -> list[dict]:
    """A run's log.csv as dicts of floats (None where a column was not logged at that step)."""
    with open(path) as f:
        return [{k: (float(v) if v != "" else None) for k, v in r.items()} for r in csv.DictReader(f)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.rl.sft", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--no-mask", action="store_true", help="train without the loss mask (into sft-nomask/)")
    p.add_argument("--control", action="store_true", help="the mask experiment with its control, 3 seeds (sft-control/)")
    args = p.parse_args(argv)
    if args.control:
        (OUT_DIR / "sft-control").mkdir(parents=True, exist_ok=True)
        result = control_runs()
        (OUT_DIR / "sft-control" / "runs.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["runs"], indent=1))
        return 0
    out = OUT_DIR / ("sft-nomask" if args.no_mask else "sft")
    train_sft(out, steps=args.steps, mask_prompt=not args.no_mask)
    print(json.loads((out / "metrics.json").read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
