"""Seeds and an ablation for the MTP chapter's training comparison.

The committed run (:mod:`kernels.speculative.mtp`) trains each arm once, at seed 1337. Here the two
arms the chapter's claim rests on, the compute-matched next-token model and the sequential D=1 arm,
are trained at more seeds, beside a third arm: the sequential module with its gradient into the
shared embedding and output head stopped (``SequentialMTP(detach_shared=True)``: the module reads and
scores through a detached copy of the table, so the MTP loss still reaches the trunk through the
hidden state, and through the trunk the input rows of the tokens it read, but not the table as the
module's input or head). Same steps, batch, schedule and data order per seed as the committed run:

    python -m kernels.speculative.mtp_seeds matched:1 sequential:1 detached:1 ...   # models/mtp/seeds/
    python -m kernels.speculative.mtp_seeds matched:1 sequential:1 --steps 800 --out models/mtp/seeds-800
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch

from kernels.speculative import mtp as M

OUT_DIR = M.MODEL_DIR / "seeds"
ARMS = {
    "matched": ("next-token 4/3 steps", M.ARMS["next-token 4/3 steps"], 4 / 3),
    "sequential": ("sequential D=1", M.ARMS["sequential D=1"], 1),
    "detached": ("sequential D=1, embedding detached", ("sequential_detached", 1, [1.0, 0.3]), 1),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.speculative.mtp_seeds", description=__doc__.splitlines()[0])
    ap.add_argument("jobs", nargs="+", help="arm:seed, arm in " + ", ".join(ARMS))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=str(OUT_DIR), help="folder for the runs (default models/mtp/seeds)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for job in args.jobs:
        arm, seed = job.split(":")
        if arm not in ARMS:
            raise ValueError(f"mtp_seeds: arm must be one of {tuple(ARMS)}, got {arm!r}")
        name, spec, scale = ARMS[arm]
        _, _, res = M.train_arm(name, steps=int(args.steps * scale), batch=args.batch, seed=int(seed),
                                arms={name: spec}, progress=False)
        res = {k: v for k, v in res.items() if k != "log"}
        res.update(seed=int(seed), command=f"python -m kernels.speculative.mtp_seeds {job} --steps {args.steps} "
                                           f"--batch {args.batch}" + (f" --out {args.out}" if out != OUT_DIR else ""))
        (out / f"{arm}-seed{seed}.json").write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
