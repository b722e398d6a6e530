"""The checks of the lab ``labs/08-kv-cache/kv-eviction-policies.ipynb``: each compares the learner's
function with the reference in :mod:`kernels.kvcache.eviction` case by case (as :func:`kernels.testing.check_cases`
does), and when they differ it says which property failed (the slip's cause), not only which elements.

The lab imports these checks, not :mod:`kernels.kvcache.eviction`, so the answers are not in its
namespace. A learner's function that raises is reported as a mismatch naming the case (for example
``scores[..., :-recent]`` with ``recent = 0``, an empty slice that ``topk`` refuses).
"""
from __future__ import annotations

import torch

from kernels.kvcache import eviction as _ref
from kernels.testing import MismatchError, assert_close


def _positions(kept: torch.Tensor, P: int, budget: int, name: str) -> list[str]:
    """Slips every kept-position result can make: dtype, length, order, duplicates, range."""
    found = []
    if kept.dtype != torch.int64:
        found.append(f"{name} must return int64 positions, got {kept.dtype}")
    if kept.shape[-1] != budget:
        found.append(f"{name} must keep exactly budget={budget} positions, got {kept.shape[-1]}")
        return found
    ordered = kept.sort(dim=-1).values
    if kept.numel() and bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        found.append("a position is kept twice (a recent position also ranked among the heavy hitters? "
                     "rank only the positions before the recent window)")
    elif kept.numel() and not torch.equal(kept, ordered):
        found.append("the kept positions are not sorted ascending: the cache keeps its tokens in position order")
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= P):
        found.append(f"positions outside the prompt 0..{P - 1}")
    return found


def _streaming_slips(args, got) -> list[str]:
    P, budget, sinks = args
    found = _positions(got, P, budget, "streaming_keep")
    if found:
        return found
    if not set(range(sinks)) <= set(got.tolist()):
        found.append(f"the sinks 0..{sinks - 1} are missing: StreamingLLM keeps the first `sinks` positions")
    if budget > sinks and P - 1 not in got.tolist():
        found.append(f"the newest position {P - 1} is missing: the recent window must end at P - 1")
    return found


def _accumulated_slips(args, got) -> list[str]:
    (probs,) = args
    B, Hkv, group, P, _ = probs.shape
    if tuple(got.shape) != (B, Hkv, P):
        return [f"the scores must have shape (B, Hkv, P) = {(B, Hkv, P)}, got {tuple(got.shape)}: sum over "
                "the group's query heads (axis 2) and the query rows (axis 3), keep the keys"]
    found = []
    total = float(got.sum())
    if abs(total - B * Hkv * group * P) > 1e-3 * B * Hkv * group * P:
        found.append(f"the scores add up to {total:.1f}, not B * Hkv * group * P = {B * Hkv * group * P}: every "
                     "query row of every head of the group gives 1 in all, so some rows or heads are missing "
                     "(only the last query row? only the first head?) or averaged instead of summed")
    return found


def _h2o_slips(args, got) -> list[str]:
    scores, budget, recent = args
    P = scores.shape[-1]
    found = _positions(got, P, budget, "h2o_keep")
    if found:
        return found
    missing = [p for p in range(P - recent, P) if not bool((got == p).any(-1).all())]
    if missing:
        found.append(f"recent positions {missing} are missing: the last `recent` positions are always kept")
    return found


def _mean_slips(args, got) -> list[str]:
    (probs,) = args
    B, Hkv, group, P, _ = probs.shape
    if tuple(got.shape) != (B, Hkv, P):
        return [f"the scores must have shape (B, Hkv, P) = {(B, Hkv, P)}, got {tuple(got.shape)}"]
    seen = torch.arange(P, 0, -1, dtype=probs.dtype)                  # key j is seen by rows j..P-1
    acc = _ref.accumulated_attention(probs)
    if torch.allclose(got * seen, acc, rtol=1e-4, atol=1e-6):
        return ["only divided by P - j: each row's attention must first be taken relative to a uniform row, "
                "times i + 1 for row i (early rows spread 1 over fewer keys)"]
    relative = _ref.accumulated_attention(probs * torch.arange(1, P + 1, dtype=probs.dtype)[:, None])
    if torch.allclose(got * P, relative, rtol=1e-4, atol=1e-6):
        return ["divided by P, the same for every key: key j is seen by P - j query rows, not P"]
    if not torch.allclose(got * seen, relative, rtol=1e-4, atol=1e-6):
        return ["times P - j it does not give the column sum of (i + 1) A_ij"]
    return []


TASKS = {
    "streaming_keep": (_ref.streaming_keep, _streaming_slips),
    "accumulated_attention": (_ref.accumulated_attention, _accumulated_slips),
    "h2o_keep": (_ref.h2o_keep, _h2o_slips),
    "mean_attention": (_ref.mean_attention, _mean_slips),
}


def check(task: str, fn, cases) -> int:
    """Run ``fn`` on every case against the reference of ``task``; on the first difference raise a
    :class:`MismatchError` that names the case, the first mismatching elements and, where one of the
    task's properties fails, the cause. Returns the number of cases checked."""
    if task not in TASKS:
        raise ValueError(f"check: unknown task {task!r}; known: {', '.join(TASKS)}")
    reference, slips = TASKS[task]
    for i, case in enumerate(cases):
        args = case if isinstance(case, tuple) else (case,)
        try:
            got = fn(*args)
        except Exception as err:                                     # the learner's code raised: name the case
            raise MismatchError(f"{task} on case {i} raised {type(err).__name__}: {err}") from err
        shapes = ", ".join(str(tuple(a.shape)) if isinstance(a, torch.Tensor) else repr(a) for a in args)
        try:
            assert_close(got, reference(*args), name=f"{task} on case {i} (inputs {shapes})")
        except Exception as err:                                     # a mismatch, or a shape or dtype refused
            causes = slips(args, got) if isinstance(got, torch.Tensor) else []
            raise MismatchError("\n".join([str(err), *("cause: " + c for c in causes)])) from None
    return len(cases)
