"""Online against offline speculative-decoding drafts, like for like, over seeds.

The committed run of :mod:`kernels.speculative.osd` compares its online draft with an offline one
distilled on one round's 64 prompts, on traffic that never shifts. :func:`compare_run` makes both
comparisons fair, per seed: the offline draft distilled before deployment on the *same* prompts the
online one served (same steps, same batch), and a traffic shift during serving (sums below 100, then
sums of 100 or more) against an offline draft that had only the pre-shift traffic.

    python -m kernels.speculative.osd_compare --seeds 0 1 2     # -> models/osd/compare.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kernels.model.gpt import GPT
from kernels.speculative import osd as O


def distill_minibatches(draft: GPT, buffer: list, prompt_len: int, *, steps: int, lr: float, batch: int,
                        seed: int) -> None:
    """``steps`` Adam steps, each on ``batch`` requests drawn at random (seeded) from the whole buffer:
    the offline draft that sees the same prompts as the online one, at the same cost per step."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randperm(len(buffer), generator=g)[:batch].tolist()
        O.distill(draft, [buffer[i] for i in idx], prompt_len, steps=1, lr=lr, opt=opt)


def compare_run(*, seed: int, rounds: int = 8, per_round: int = 64, held_out: int = 64, steps: int = 30,
                lr: float = 3e-3) -> dict:
    """Online against offline, like for like, for one seed (the traffic's order and the minibatches).

    stationary: the online draft (``rounds`` updates of ``steps`` on each round's buffer) against the
    offline one distilled before deployment on the *same* rounds * per_round prompts, with as many
    steps of per_round requests. shift: the traffic moves during serving, sums below 100 for the first
    half of the rounds and sums of 100 or more for the second (three-digit answers); the offline draft
    has the pre-shift half only; both are measured on held-out sums of 100 or more, the online one's
    sampled alpha after every round. The buffers are recorded by plain greedy serving: the same
    answers as speculative serving (asserted in :func:`kernels.speculative.osd.evaluate`), so the
    same (tokens, p) up to rounding."""
    from kernels.model.gpt import load_pretrained
    from kernels.rl import task
    from kernels.rl.sft import load_sft
    from kernels.speculative.drafts import truncated_copy

    torch.manual_seed(seed)
    target, base = load_sft(), load_pretrained()
    train_pairs, held_pairs = task.split_pairs()
    train_pairs = train_pairs[torch.randperm(len(train_pairs), generator=torch.Generator().manual_seed(seed))]

    def buffers(pairs):                                            # one buffer per round of traffic
        return [O.serve(target, task.prompts(pairs[r * per_round: (r + 1) * per_round]).tolist(), record=True)["buffer"]
                for r in range(len(pairs) // per_round)]

    def online(bufs, probe=None):
        draft, curve = truncated_copy(base, 1), []
        opt = torch.optim.Adam(draft.parameters(), lr=lr)
        for b in bufs:
            O.distill(draft, b, task.PROMPT_LEN, steps=steps, lr=lr, opt=opt)
            if probe is not None:
                curve.append(O.sampled_alpha(draft, probe, task.PROMPT_LEN)[0])
        return draft, curve

    def offline(bufs):
        draft = truncated_copy(base, 1)
        distill_minibatches(draft, [x for b in bufs for x in b], task.PROMPT_LEN, steps=steps * rounds, lr=lr,
                            batch=per_round, seed=seed)
        return draft

    held = task.prompts(held_pairs[:held_out]).tolist()
    plain = O.serve(target, held, record=True)
    bufs = buffers(train_pairs[: rounds * per_round])
    stationary = {"online": O.evaluate(target, online(bufs)[0], held, plain),
                  "offline, same prompts": O.evaluate(target, offline(bufs), held, plain)}

    big = train_pairs.sum(1) >= 100
    half = rounds // 2 * per_round
    low, high = buffers(train_pairs[~big][:half]), buffers(train_pairs[big][:half])
    held_big = task.prompts(held_pairs[held_pairs.sum(1) >= 100][:held_out]).tolist()
    plain_big = O.serve(target, held_big, record=True)
    draft, curve = online(low + high, probe=plain_big["buffer"])
    shift = {"online": O.evaluate(target, draft, held_big, plain_big),
             "offline, pre-shift prompts": O.evaluate(target, offline(low), held_big, plain_big),
             "online alpha after each round": curve}
    return dict(seed=seed, config=dict(rounds=rounds, per_round=per_round, held_out=held_out, steps=steps, lr=lr),
                plain=dict(tokens=plain["tokens"], forwards=plain["forwards"]),
                plain_shift=dict(tokens=plain_big["tokens"], forwards=plain_big["forwards"]),
                stationary=stationary, shift=shift)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.speculative.osd_compare", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    runs = [compare_run(seed=s) for s in args.seeds]
    argv = sys.argv[1:] if argv is None else argv
    out = dict(command="python -m kernels.speculative.osd_compare " + " ".join(argv), runs=runs,
               wall_seconds=time.time() - t0)
    O.OUT_DIR.mkdir(parents=True, exist_ok=True)
    (O.OUT_DIR / "compare.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
