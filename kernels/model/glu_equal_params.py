"""Does the gate help at equal parameters? A next-byte experiment, run once and committed.

``python -m kernels.model.glu_equal_params`` trains a small next-byte model on the Shakespeare text whose
only difference between arms is its MLP block, at equal weights (98,304 in the block):

    plain (h = 384):  gelu, silu, relu2      y = phi(x W_1^T) W_2^T           2 * 128 * 384 weights
    gated (h = 256):  swiglu, geglu          y = (phi(x W_g^T) * x W_u^T) W_d^T   3 * 128 * 256 weights

Every arm starts from the same seed and sees the same batches in the same order, for three seeds, at
the learning rate of the chapter (3e-3) and, for GELU and SwiGLU, at 1e-3 and 1e-2 as well. The run
writes :data:`RUN` (validation curves, the first training losses of each run); the chapter reads it
and never trains, and ``tests/test_mlp.py`` re-runs the first steps of one arm against the log.
About 40 s on one core. It lives in the training package beside the optimizer comparison
(kernels.model imports kernels.mlp for the GPT's SwiGLU, so the experiment cannot sit in kernels.mlp).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

RUN = Path(__file__).resolve().parents[2] / "models" / "gated-mlp" / "equal_params.json"
K, E = 8, 16                      # context bytes, embedding per byte: d = K * E = 128
D = K * E
HIDDEN = {"plain": 384, "gated": 256}          # 2 * 128 * 384 = 3 * 128 * 256 = 98,304 weights
ARMS = {"gelu": "plain", "silu": "plain", "relu2": "plain", "swiglu": "gated", "geglu": "gated"}
SETTINGS = dict(steps=300, batch=128, eval_every=25, val_windows=2048, head_steps=10)
SEEDS = (0, 1, 2)
LR = 3e-3
LR_SWEEP = {"lrs": (1e-3, 1e-2), "arms": ("gelu", "swiglu")}


def _act(arm: str, g: torch.Tensor) -> torch.Tensor:
    """The activation phi of each arm, applied to the (B, h) projection."""
    if arm in ("gelu", "geglu"):
        return F.gelu(g)
    if arm in ("silu", "swiglu"):
        return F.silu(g)
    return F.relu(g).square()                  # relu2: Primer's squared ReLU


class NextByte(torch.nn.Module):
    """bytes (B, K) -> logits (B, 256): embed, concatenate (B, 128), x + MLP(x), RMSNorm, linear."""

    def __init__(self, arm: str):
        super().__init__()
        if arm not in ARMS:
            raise ValueError(f"NextByte: arm must be one of {sorted(ARMS)}, got {arm!r}")
        self.arm, gated = arm, ARMS[arm] == "gated"
        h = HIDDEN[ARMS[arm]]
        self.emb = torch.nn.Embedding(256, E)
        self.w_in = torch.nn.Linear(D, h, bias=False)                       # W_gate, or W_1 of a plain MLP
        self.w_up = torch.nn.Linear(D, h, bias=False) if gated else None
        self.w_down = torch.nn.Linear(h, D, bias=False)
        self.norm, self.out = torch.nn.RMSNorm(D), torch.nn.Linear(D, 256, bias=False)

    def forward(self, ctx: torch.Tensor) -> torch.Tensor:
        x = self.emb(ctx).flatten(1)                                         # (B, 128)
        hidden = _act(self.arm, self.w_in(x))                                # (B, h)
        if self.w_up is not None:
            hidden = hidden * self.w_up(x)                                   # the gate times the linear up
        return self.out(self.norm(x + self.w_down(hidden)))


def block_weights(net: NextByte) -> int:
    """Weights of the MLP block (w_in, w_up, w_down)."""
    return sum(p.numel() for n, p in net.named_parameters() if n.startswith("w_"))


def windows(tokens: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random windows: (n, K) context bytes and the (n,) byte after each."""
    start = torch.randint(0, len(tokens) - K - 1, (n,), generator=gen)
    return tokens[start[:, None] + torch.arange(K)], tokens[start + K]


def splits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training bytes, and the fixed validation windows from the held-out tenth (seed 2)."""
    from kernels.model import data

    train_tok, val_tok = data.train_val_split(data.encode(data.load_text()))
    val_x, val_y = windows(val_tok, SETTINGS["val_windows"], torch.Generator().manual_seed(2))
    return train_tok, val_x, val_y


def fit(arm: str, seed: int, lr: float, train_tok, val_x, val_y, *, steps: int | None = None,
        progress: bool = False) -> dict:
    """AdamW (no weight decay) from ``torch.manual_seed(seed)``; batches from generator ``1000 + seed``,
    the same for every arm. Returns the validation curve (every ``eval_every`` steps) and the first
    ``head_steps`` training losses."""
    from tqdm.auto import tqdm

    steps = SETTINGS["steps"] if steps is None else steps
    torch.manual_seed(seed)
    net = NextByte(arm)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    batches = torch.Generator().manual_seed(1000 + seed)
    curve, head = [], []
    for step in tqdm(range(1, steps + 1), desc=f"{arm} seed {seed} lr {lr:g}", disable=not progress, leave=False):
        x, y = windows(train_tok, SETTINGS["batch"], batches)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step <= SETTINGS["head_steps"]:
            head.append(loss.item())
        if step % SETTINGS["eval_every"] == 0:
            with torch.no_grad():
                curve.append(F.cross_entropy(net(val_x), val_y).item())
    return {"arm": arm, "seed": seed, "lr": lr, "block_weights": block_weights(net), "val": curve, "train_head": head}


def run(progress: bool = True) -> dict:
    """Every arm at :data:`LR` for :data:`SEEDS`, then GELU and SwiGLU at the other learning rates."""
    train_tok, val_x, val_y = splits()
    plan = [(arm, seed, LR) for seed in SEEDS for arm in ARMS]
    plan += [(arm, seed, lr) for lr in LR_SWEEP["lrs"] for seed in SEEDS for arm in LR_SWEEP["arms"]]
    runs = [fit(arm, seed, lr, train_tok, val_x, val_y, progress=progress) for arm, seed, lr in plan]
    return {"command": "python -m kernels.model.glu_equal_params", "threads": 1, "d": D, "hidden": HIDDEN, "arms": ARMS,
            "settings": SETTINGS, "seeds": list(SEEDS), "lr": LR, "lr_sweep": LR_SWEEP, "runs": runs}


def load() -> dict:
    """The committed run (:data:`RUN`)."""
    return json.loads(RUN.read_text())


def final(results: dict, arm: str, lr: float | None = None) -> list[float]:
    """The last validation loss of ``arm`` at ``lr`` (the main one by default), one per seed in seed order."""
    lr = results["lr"] if lr is None else lr
    runs = sorted((r for r in results["runs"] if r["arm"] == arm and r["lr"] == lr), key=lambda r: r["seed"])
    return [r["val"][-1] for r in runs]


if __name__ == "__main__":
    import time

    torch.set_num_threads(1)
    t0 = time.time()
    result = run()
    result["seconds"] = round(time.time() - t0, 1)
    RUN.parent.mkdir(parents=True, exist_ok=True)
    RUN.write_text(json.dumps(result, indent=1) + "\n")
    print(RUN, f"{result['seconds']} s")
    for arm in ARMS:
        print(arm, [round(v, 4) for v in final(result, arm)])
