"""EAGLE's token input, ablated: is the draft's advantage over Medusa autoregression or the token?

The EAGLE draft reads [f_t ; E x_{t+1}]: the target's feature *and* the token sampled from it. Medusa's
heads read the feature alone. :class:`FeatureOnlyDraft` is the same one-layer draft (the same
parameters, the same seeded initialisation) with the token half of its input zeroed, so it is still
autoregressive in feature space (it feeds its own g back) but never told which token was chosen.
Each job trains one arm for one seed with :func:`kernels.speculative.eagle.train_draft` (EAGLE-1
loss, no training-time test) and records the chain acceptance by depth on the held-out windows and
the greedy chain's target forwards on the EAGLE chapter's three prompts:

    python -m kernels.speculative.eagle_ablation full:1 full:2 feature_only:0 feature_only:1 feature_only:2

(arm ``full`` at seed 0 is the chapter's committed ``draft``). Results: models/eagle/ablation/.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kernels.speculative import eagle as G

OUT_DIR = G.MODEL_DIR / "ablation"
PROMPTS = (b"ROMEO:\nWhat is the", b"HAMLET:\nTo be, or not", b"KING LEAR:\nWhat says ")
N_NEW, DEPTH = 32, 4


class FeatureOnlyDraft(G.EagleDraft):
    """The EAGLE draft without its token input: u = W_fc [f ; 0] + b."""

    def fuse(self, f: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return super().fuse(f, torch.zeros_like(e))


ARMS = {"full": G.EagleDraft, "feature_only": FeatureOnlyDraft}


def load(arm: str, seed: int) -> G.EagleDraft:
    """A trained ablation draft (models/eagle/ablation/<arm>-seed<seed>.pt)."""
    draft = ARMS[arm](G.load_draft("draft").config)
    draft.load_state_dict(torch.load(OUT_DIR / f"{arm}-seed{seed}.pt", map_location="cpu", weights_only=True))
    return draft.eval()


def evaluate(model, draft: G.EagleDraft) -> dict:
    """Chain acceptance by depth on the held-out windows, and greedy chain forwards on PROMPTS
    (asserted equal to plain greedy decoding)."""
    from kernels.speculative.medusa import plain_generate

    E = model.wte.weight.detach()
    x = G.eval_windows()
    hits, totals = G.chain_accuracy(draft, G.target_features(model, x), x, E)
    forwards = 0
    for p in PROMPTS:
        out, n, _ = G.eagle_generate(model, draft, list(p), N_NEW, mode="chain", depth=DEPTH)
        if out != plain_generate(model, list(p), N_NEW):
            raise AssertionError("EAGLE chain decoding differs from plain greedy decoding")
        forwards += n
    return dict(chain_hits=hits, chain_totals=totals, forwards=forwards, tokens=N_NEW * len(PROMPTS))


def arm_and_seed(job: str, arms: dict, prog: str) -> tuple[str, int]:
    """One "arm:seed" job of a training script's command line, the arm checked against ``arms``."""
    arm, seed = job.split(":")
    if arm not in arms:
        raise ValueError(f"{prog}: arm must be one of {tuple(arms)}, got {arm!r}")
    return arm, int(seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.speculative.eagle_ablation", description=__doc__.splitlines()[0])
    ap.add_argument("jobs", nargs="+", help="arm:seed, arm in " + ", ".join(ARMS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--windows", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from kernels.model.gpt import load_pretrained

    model = load_pretrained()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for job in args.jobs:
        arm, seed = arm_and_seed(job, ARMS, "eagle_ablation")
        t0 = time.perf_counter()
        draft, _ = G.train_draft(model, args.steps, n_windows=args.windows, batch=args.batch, seed=seed,
                                 draft_cls=ARMS[arm], progress=False)
        seconds = time.perf_counter() - t0
        torch.save({k: v.detach().clone() for k, v in draft.state_dict().items()}, OUT_DIR / f"{arm}-seed{seed}.pt")
        result = dict(arm=arm, seed=seed, train_seconds=round(seconds, 1),
                      command=(f"python -m kernels.speculative.eagle_ablation {job} --steps {args.steps} "
                               f"--batch {args.batch} --windows {args.windows}"),
                      **evaluate(model, draft))
        (OUT_DIR / f"{arm}-seed{seed}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
