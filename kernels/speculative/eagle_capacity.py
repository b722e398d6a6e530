"""EAGLE against Medusa at equal capacity: Medusa heads as large as the EAGLE draft.

The EAGLE chapter's draft has 233,856 parameters, Medusa's four heads 66,048 (one C x C residual
block each, C = 128). :class:`WideMedusaHeads` gives each head a residual MLP of width HIDDEN = 227,
4 (2 C H + H + C) = 233,868 parameters, 12 more than the draft: the same interface and the same
zero start as Medusa's heads (the second matrix is zero, so each head begins as the base model's own
head), only wider. Each job trains one arm for one seed with :func:`kernels.speculative.medusa.train_heads`
on the EAGLE drafts' recipe (:mod:`kernels.speculative.eagle_ablation`: 300 steps of 16 windows drawn
from 256, the same seeded windows as the draft of that seed), so that capacity, data and steps all
match the drafts they are compared with, and records the heads' rank counts on the held-out windows
and the greedy chain's target forwards (depth 4, the chain the EAGLE chapter compares) on the
ablation's three prompts:

    python -m kernels.speculative.eagle_capacity wide:0 wide:1 wide:2 medusa:0 medusa:1 medusa:2

Arm ``medusa`` is the Medusa chapter's heads on that recipe (its committed heads had 1200 steps on
512 windows). Results: models/eagle/capacity/.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.speculative import eagle as G, medusa as M
from kernels.speculative.eagle_ablation import DEPTH, N_NEW, PROMPTS, arm_and_seed

OUT_DIR = G.MODEL_DIR / "capacity"
HIDDEN = 227                  # 4 heads x (2 * 128 * 227 + 227 + 128) = 233,868 ~ the EAGLE draft's 233,856
STEPS, BATCH, WINDOWS = 300, 16, 256        # the EAGLE drafts' recipe (eagle_ablation's defaults)


class WideMedusaHeads(nn.Module):
    """K residual MLP heads on the final hidden state, sharing the base model's (frozen) LM head:
    z_k = h + W2_k SiLU(W1_k h + b1_k) + b2_k, logits_k = z_k E^T."""

    def __init__(self, d_model: int, n_heads: int = M.N_HEADS, hidden: int = HIDDEN):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_heads, hidden, d_model) * 0.02)   # (K, H, C)
        self.b1 = nn.Parameter(torch.zeros(n_heads, hidden))                  # (K, H)
        self.w2 = nn.Parameter(torch.zeros(n_heads, d_model, hidden))         # (K, C, H) zero: start as the base head
        self.b2 = nn.Parameter(torch.zeros(n_heads, d_model))                 # (K, C)

    @property
    def n_heads(self) -> int:
        return self.w1.shape[0]

    def forward(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """h (..., C) final normed hidden states, lm_head E (V, C) -> logits (..., K, V)."""
        u = torch.einsum("...c,khc->...kh", h, self.w1) + self.b1                # (..., K, H)  W1 h + b1
        z = h[..., None, :] + torch.einsum("...kh,kch->...kc", F.silu(u), self.w2) + self.b2   # (..., K, C)
        return z @ lm_head.T                                                  # (..., K, V)  @ E^T


ARMS = {"medusa": M.MedusaHeads, "wide": WideMedusaHeads}


def load(arm: str, seed: int) -> nn.Module:
    """Trained heads: models/eagle/capacity/<arm>-seed<seed>.pt."""
    state = torch.load(OUT_DIR / f"{arm}-seed{seed}.pt", map_location="cpu", weights_only=True)
    K, C = state["b2" if arm == "wide" else "b"].shape                  # the output biases: (K, C)
    heads = ARMS[arm](C, K)
    heads.load_state_dict(state)
    return heads.eval()


@torch.no_grad()
def evaluate(model, heads: nn.Module) -> dict:
    """Rank counts of each head on Medusa's held-out windows, and greedy chain forwards on PROMPTS
    (asserted equal to plain greedy decoding)."""
    x = M.eval_windows()
    chain = G.static_tree(DEPTH)
    forwards = 0
    for p in PROMPTS:
        out, n, _ = M.medusa_generate(model, heads, list(p), N_NEW, chain)
        if out != M.plain_generate(model, list(p), N_NEW):
            raise AssertionError("Medusa chain decoding differs from plain greedy decoding")
        forwards += n
    return dict(rank_counts=M.rank_accuracy(model, heads, x).tolist(), n_scored=M.n_scored(x).tolist(),
                forwards=forwards, tokens=N_NEW * len(PROMPTS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.speculative.eagle_capacity", description=__doc__.splitlines()[0])
    ap.add_argument("jobs", nargs="+", help="arm:seed, arm in " + ", ".join(ARMS))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from kernels.model.gpt import load_pretrained

    model = load_pretrained()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for job in args.jobs:
        arm, seed = arm_and_seed(job, ARMS, "eagle_capacity")
        t0 = time.perf_counter()
        heads, log = M.train_heads(model, STEPS, n_windows=WINDOWS, batch=BATCH, seed=seed,
                                   heads_cls=ARMS[arm], progress=False)
        seconds = time.perf_counter() - t0
        heads.eval()
        torch.save({k: v.detach().clone() for k, v in heads.state_dict().items()}, OUT_DIR / f"{arm}-seed{seed}.pt")
        result = dict(arm=arm, seed=seed, parameters=sum(p.numel() for p in heads.parameters()),
                      train_seconds=round(seconds, 1), first_step_losses=log[0],
                      final_loss=[round(sum(r[k] for r in log[-50:]) / 50, 4) for k in range(heads.n_heads)],
                      command=f"python -m kernels.speculative.eagle_capacity {job}", **evaluate(model, heads))
        (OUT_DIR / f"{arm}-seed{seed}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: result[k] for k in ("arm", "seed", "parameters", "train_seconds", "final_loss", "forwards")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
