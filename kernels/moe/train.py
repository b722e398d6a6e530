"""Train the small MoE GPT, one study at a time: ``python -m kernels.moe.train --study NAME``.

A *study* is a list of *arms* (:data:`ARMS`: a name and the :class:`~kernels.moe.model.MoEConfig`
fields it changes), trained from the same initial seed on the same batches for the same number of
steps, and written to ``models/moe/<file>`` (:data:`STUDIES`). Every log holds, per arm and per
step, the training loss, the balancing loss, the expert loads of every layer (assignments per
expert, integers; routed layers only: a Soft MoE layer's are p B by construction) and, with a
capacity, the dropped assignments; the validation loss every
``eval_every`` steps; and at the end :func:`final_eval` (validation loss without capacity, the
prefix-only loss that a decoder would see, the number of device groups each token's experts span).
Deterministic for a given torch version and thread count: the chapters and tests re-run the first
steps and compare with the log.

Studies (each a chapter of the MoE part):

* ``balance`` (results.json): no balancing, the Switch loss, the z-loss, both, the bias update, and
  the two controls that separate the bias update from sigmoid scoring;
* ``experts``: plain top-2 of 8 experts against fine-grained (top-4 of 16 half-width experts),
  fine-grained with one shared expert (top-3 of 15 plus 1), and LatentMoE (top-4 of 16 experts in a
  32-wide latent space), at equal active expert parameters; ``top2`` also saves its weights for the
  offloading chapter's routing trace;
* ``device``: the fine-grained MoE with its 16 experts on 4 "devices", each token limited to 2 or 1;
* ``capacity``: the top-2 MoE with capacity factors 1.0 and 1.25 (dropping) against dropless;
* ``soft``: Soft MoE with the top-2 MoE's expert FLOPs (p = k S / E = 16 slots per expert), as the
  course builds it (8 experts, both layers, raw logits) and closer to the paper's released
  configuration (``soft-paper``: one slot per expert, so 128 experts for the same 128 slots;
  normalised logits with a learned scale; Soft MoE in the last layer only, the first a dense SwiGLU
  of the same FLOPs), three seeds each;
* ``seeds``: the top-2 and fine-grained arms from two more seeds: the spread that a difference
  between arms must exceed before it means anything.

The same code on another CPU (instruction set, BLAS) may flip a router tie after some dozens of
steps, and the runs then part ways: the logs reproduce on the machine and thread count they name.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kernels.model import data
from kernels.model.train import lr_at
from kernels.moe.group_route import groups_per_token
from kernels.moe.model import MODEL_DIR, MoEConfig, MoEGPT, MoELayer

SEED = 1337
VAL_WINDOWS = 16
DEVICE_GROUPS = 4          # the device study's "devices": 16 experts, 4 on each
RESULTS = MODEL_DIR / "results.json"
CHECKPOINT = MODEL_DIR / "top2.pt"
SOFT_CHECKPOINT = MODEL_DIR / "soft.pt"
CHECKPOINTS = {"top2": CHECKPOINT, "soft": SOFT_CHECKPOINT}      # the arms whose weights are kept
FINE = dict(balance="switch", n_experts=16, top_k=4, d_expert=32)
SOFT_PAPER = dict(layer="soft", n_experts=128, slots_per_expert=1, soft_normalize=True, soft_layers=1)
ARMS = {
    # balance: the config's balance setting; "bias" routes with sigmoid, the others with softmax ...
    "none": dict(balance="none"), "switch": dict(balance="switch"), "z": dict(balance="z"),
    "switch+z": dict(balance="switch+z"), "bias": dict(balance="bias"),
    # ... and the two controls that swap the score function
    "softmax+bias": dict(balance="bias", router_score="softmax"),
    "sigmoid+switch": dict(balance="switch", router_score="sigmoid"),
    # experts: equal active expert parameters, 2 * 3 * 64 * 64 per layer and token
    "top2": dict(balance="switch"),
    "fine": FINE,
    "fine+shared": dict(FINE, n_experts=15, top_k=3, n_shared=1),
    "latent": dict(FINE, d_latent=32, d_expert=52),
    # device: the fine-grained arm with its experts on DEVICE_GROUPS devices
    "devices2": dict(FINE, n_groups=DEVICE_GROUPS, topk_groups=2),
    "devices1": dict(FINE, n_groups=DEVICE_GROUPS, topk_groups=1),
    # capacity: the top-2 arm, dropping past the capacity
    "cf1.0": dict(balance="switch", capacity_factor=1.0),
    "cf1.25": dict(balance="switch", capacity_factor=1.25),
    # soft: slots = k * block_size = 128, the top-2 arm's expert FLOPs
    "soft": dict(layer="soft", slots_per_expert=16),
    "soft@1338": dict(layer="soft", slots_per_expert=16, seed=1338),
    "soft@1339": dict(layer="soft", slots_per_expert=16, seed=1339),
    # ... and as the paper's released models use it: 1 slot per expert, normalised, last layer only
    "soft-paper": SOFT_PAPER,
    "soft-paper@1338": dict(SOFT_PAPER, seed=1338),
    "soft-paper@1339": dict(SOFT_PAPER, seed=1339),
    # seeds: two arms again from other initial weights and batches, to measure the noise floor
    "top2@1338": dict(balance="switch", seed=1338), "top2@1339": dict(balance="switch", seed=1339),
    "fine@1338": dict(FINE, seed=1338), "fine@1339": dict(FINE, seed=1339),
}
STUDIES = {
    "balance": ("results.json", ["none", "switch", "z", "switch+z", "bias", "softmax+bias", "sigmoid+switch"]),
    "experts": ("experts.json", ["top2", "fine", "fine+shared", "latent"]),
    "device": ("device.json", ["devices2", "devices1"]),
    "capacity": ("capacity.json", ["cf1.0", "cf1.25"]),
    "soft": ("soft.json", ["soft", "soft@1338", "soft@1339", "soft-paper", "soft-paper@1338", "soft-paper@1339"]),
    "seeds": ("seeds.json", ["top2@1338", "top2@1339", "fine@1338", "fine@1339"]),
}
METHODS = {m: ARMS[m]["balance"] for m in STUDIES["balance"][1]}     # the balancing chapter's arms
DEFAULTS = dict(steps=600, batch_size=16, max_lr=3e-3, min_lr=3e-4, warmup=30, weight_decay=0.1, eval_every=100)


def machine() -> str:
    """The CPU the log was written on (its model name where the OS tells it), and its core count."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        name = names[0] if names else name
    return f"{name}, {os.cpu_count()} cores"


def study_path(study: str) -> Path:
    if study not in STUDIES:
        raise ValueError(f"study must be one of {list(STUDIES)}, got {study!r}")
    return MODEL_DIR / STUDIES[study][0]


def arm_config(method: str, base: MoEConfig | None = None) -> MoEConfig:
    if method not in ARMS:
        raise ValueError(f"run: method must be one of {list(ARMS)}, got {method!r}")
    return replace(base or MoEConfig(), **{k: v for k, v in ARMS[method].items() if k != "seed"})


@torch.no_grad()
def evaluate(model: MoEGPT, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    loss = float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    model.train()
    return loss


@torch.no_grad()
def prefix_loss(model: MoEGPT, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss a decoder sees: position t predicted from tokens 0..t only (one forward per prefix).
    Equal to :func:`evaluate` for a causal model; lower teacher-forced losses that this does not
    reproduce came from looking ahead."""
    model.eval()
    logits = torch.stack([model(x[:, : t + 1])[:, -1] for t in range(x.shape[1])], dim=1)   # (B, S, V)
    model.train()
    return float(F.cross_entropy(logits.flatten(0, 1), y.flatten()))


@torch.no_grad()
def swapped_future_loss(model: MoEGPT, x: torch.Tensor, y: torch.Tensor) -> float:
    """Position t predicted from the true tokens 0..t followed by an *unrelated* future (tokens t+1..
    of the previous validation window), the window's length kept. Against :func:`prefix_loss` it
    separates what the future's content gives a non-causal model from what a short input does to
    it; a causal model gives :func:`evaluate`'s loss."""
    model.eval()
    other = x.roll(1, dims=0)                                                            # another window's tokens
    logits = torch.stack([model(torch.cat([x[:, : t + 1], other[:, t + 1:]], dim=1))[:, t]
                          for t in range(x.shape[1])], dim=1)                           # (B, S, V)
    model.train()
    return float(F.cross_entropy(logits.flatten(0, 1), y.flatten()))


@torch.no_grad()
def final_eval(model: MoEGPT, x: torch.Tensor, y: torch.Tensor) -> dict:
    """What the chapters read at the end of a run, beyond the validation loss."""
    cfg = model.config
    out = {}
    if cfg.capacity_factor is not None:                     # the same weights served dropless
        dropless = MoEGPT(replace(cfg, capacity_factor=None))
        dropless.load_state_dict(model.state_dict())
        out["val_dropless"] = round(evaluate(dropless, x, y), 5)
    if cfg.layer == "soft" or cfg == arm_config("top2"):
        out["val_prefix"] = round(prefix_loss(model, x, y), 5)
    if cfg.layer == "soft":
        out["val_swapped_future"] = round(swapped_future_loss(model, x, y), 5)
    if cfg.layer == "topk" and cfg.n_experts % DEVICE_GROUPS == 0:
        model.eval()
        model(x)
        model.train()
        spans = [groups_per_token(layer.last_ids, cfg.n_experts, DEVICE_GROUPS) for layer in model.moe_layers]
        out["devices_per_token"] = [torch.bincount(n, minlength=DEVICE_GROUPS + 1)[1:].tolist() for n in spans]
    return out


def run(method: str, *, steps: int, schedule_steps: int, batch_size: int, max_lr: float, min_lr: float,
        warmup: int, weight_decay: float, eval_every: int, config: MoEConfig | None = None,
        progress: bool = True, checkpoint: Path | None = None) -> dict:
    """Train one model, arm ``method`` of :data:`ARMS`, for ``steps`` steps of a ``schedule_steps`` schedule."""
    config = arm_config(method, config)
    seed = ARMS[method].get("seed", SEED)
    torch.manual_seed(seed)
    tokens = data.encode(data.load_text())
    train_tokens, val_tokens = data.train_val_split(tokens)
    val_x, val_y = data.fixed_windows(val_tokens, VAL_WINDOWS, config.block_size)
    gen = torch.Generator().manual_seed(seed)
    model = MoEGPT(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=max_lr, betas=(0.9, 0.95))
    routed = [layer for layer in model.moe_layers if isinstance(layer, MoELayer)]      # whose loads vary
    log = {"method": method, "config": ARMS[method], "train_loss": [], "balance_loss": [], "val": []}
    if routed:
        log["loads"] = []
    if config.capacity_factor is not None:
        log["dropped"] = []
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
        if routed:
            log["loads"].append([layer.last_load.tolist() for layer in routed])
        if "dropped" in log:
            log["dropped"].append([layer.last_dropped for layer in model.moe_layers])
        if step % eval_every == 0 or step == steps:
            log["val"].append([step, round(evaluate(model, val_x, val_y), 5)])
            bar.set_postfix(loss=f"{lm.item():.3f}", val=f"{log['val'][-1][1]:.3f}")
    if config.layer == "topk":
        log["final_bias"] = [[round(v, 6) for v in layer.bias.tolist()] for layer in model.moe_layers]
    if steps == schedule_steps:
        log["final"] = final_eval(model, val_x, val_y)
    if checkpoint is not None:
        torch.save({"config": asdict(config), "state_dict": model.state_dict()}, checkpoint)
    return log


def load_checkpoint(path: Path = CHECKPOINT) -> MoEGPT:
    """The model a study saved (``top2``: the experts study's top-2 arm after its last step)."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = MoEGPT(MoEConfig(**blob["config"]))
    model.load_state_dict(blob["state_dict"])
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.moe.train", description=__doc__.splitlines()[0])
    p.add_argument("--study", default="balance", choices=list(STUDIES))
    p.add_argument("--arms", nargs="*", help="train only these arms and merge them into the study's file")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = study_path(args.study)
    arms = args.arms or STUDIES[args.study][1]
    unknown = [a for a in arms if a not in STUDIES[args.study][1]]
    if unknown:
        p.error(f"arms {unknown} are not in study {args.study!r}: {STUDIES[args.study][1]}")
    settings = dict(DEFAULTS, steps=args.steps)
    previous = json.loads(out.read_text()) if args.arms and out.exists() else {"runs": [], "seconds": {}}
    runs = {r["method"]: r for r in previous["runs"]}
    # a log written before per-arm seconds were kept gives its total for the arms it held
    seconds = dict(previous.get("seconds", {"+".join(runs): previous.get("train_seconds")} if runs else {}))
    for arm in arms:
        start = time.perf_counter()
        runs[arm] = run(arm, schedule_steps=args.steps, checkpoint=CHECKPOINTS.get(arm), **settings)
        seconds[arm] = round(time.perf_counter() - start)
    results = {"config": json.loads(MoEConfig().to_json()), "settings": settings, "seed": SEED, "threads": args.threads,
               "val_windows": VAL_WINDOWS, "torch": torch.__version__, "seconds": seconds,
               "train_seconds": sum(seconds.values()), "machine": machine(),
               "command": f"python -m kernels.moe.train --study {args.study}",
               "runs": [runs[a] for a in STUDIES[args.study][1] if a in runs]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, separators=(",", ":")) + "\n")
    for r in results["runs"]:
        print(f"{r['method']:>14}: final val loss {r['val'][-1][1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
