"""Drafts without a second model, and greedy speculative decoding on the course's tiny GPT.

* :func:`prompt_lookup`: prompt lookup decoding. Take the last n tokens of the sequence (prompt and
  what has been generated so far), find their most recent earlier occurrence, and propose the
  tokens that followed it; try n = max_ngram first, down to min_ngram. No draft model at all: it
  pays off when the answer copies from its context (code edits, summaries, quoting, repetition).
* :class:`NgramPool`: the n-gram pool of lookahead decoding (Fu et al. 2024): every n-gram seen so
  far, keyed by its first token(s); a draft is the most recently seen continuation of the current
  last token(s). Lookahead fills the pool with n-grams produced by Jacobi iterations in the same
  forward as the verification; here the pool is filled from the text itself (see :func:`jacobi_greedy`
  for the Jacobi half on its own).
* :func:`speculative_greedy`: the target verifies a draft of up to gamma tokens in one forward over
  the KV cache; with greedy decoding the rule is "keep the drafts while they equal the target's argmax,
  then emit the target's own token", so the output equals plain greedy decoding token for token.
  Rejected drafts are rolled back by shortening the cache (their keys are overwritten later).
* :func:`jacobi_greedy`: Jacobi decoding (Santilli et al. 2023; the first branch of lookahead
  decoding): guess W future tokens, run the target once over sequence + guesses, replace each guess
  by the argmax at its position; the tokens up to the first wrong guess are final.

A drafter is a function ``tokens (list of int) -> draft (list of int)``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.model.gpt import GPT, KVCache


def prompt_lookup(tokens: list[int], num_draft: int, *, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``num_draft`` tokens that followed the latest earlier occurrence of the sequence's last
    n-gram, longest n first; [] when no n-gram recurs."""
    if num_draft < 1 or min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"prompt_lookup: need num_draft >= 1 and 1 <= min_ngram <= max_ngram, got "
                         f"{num_draft}, {min_ngram}, {max_ngram}")
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        pattern = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):                   # latest occurrence first, not the suffix itself
            if tokens[start: start + n] == pattern:
                return tokens[start + n: start + n + num_draft]
    return []


class NgramPool:
    """n-grams of ``n`` tokens keyed by their first ``n - 1``; the latest continuation wins."""

    def __init__(self, n: int = 4):
        if n < 2:
            raise ValueError(f"NgramPool: n must be >= 2, got {n}")
        self.n = n
        self.pool: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.seen = 0                                             # tokens of the sequence already added

    def add(self, tokens: list[int]) -> None:
        """Add every n-gram that ends in the tokens not added before."""
        n = self.n
        for end in range(max(self.seen, n), len(tokens) + 1):
            self.pool[tuple(tokens[end - n: end - 1])] = (tokens[end - 1],)
        self.seen = len(tokens)

    def draft(self, tokens: list[int], num_draft: int) -> list[int]:
        """Chain the pool: each next token is the continuation of the last n - 1 (drafted) tokens."""
        self.add(tokens)
        seq, out = list(tokens), []
        while len(out) < num_draft:
            nxt = self.pool.get(tuple(seq[len(seq) - self.n + 1:]))
            if nxt is None:
                break
            out += nxt
            seq += nxt
        return out[:num_draft]


@torch.no_grad()
def speculative_greedy(model: GPT, prompt: list[int], max_new_tokens: int, drafter: Callable[[list[int]], list[int]],
                       gamma: int, *, _keep_rejected: bool = False) -> tuple[list[int], int, list[int]]:
    """Greedy decoding with drafts verified by the target: (tokens, target forwards, accepted per step).

    The forwards count the prefill too, as plain decoding's max_new_tokens forwards do.
    ``_keep_rejected=True`` is a deliberately broken variant: at a rejection it emits the rejected
    draft token instead of the target's."""
    if gamma < 1 or max_new_tokens < 1:
        raise ValueError(f"speculative_greedy: gamma and max_new_tokens must be >= 1, got {gamma}, {max_new_tokens}")
    if len(prompt) + max_new_tokens + gamma > model.config.block_size:
        raise ValueError(f"speculative_greedy: {len(prompt)} + {max_new_tokens} + gamma={gamma} tokens exceed "
                         f"block_size={model.config.block_size}")
    cache = KVCache.empty(model.config, 1)
    logits = model(torch.tensor([prompt]), cache=cache)[0, -1]           # (V,) prefill
    out = list(prompt) + [int(logits.argmax())]
    forwards, accepted = 1, []
    while len(out) - len(prompt) < max_new_tokens:
        left = max_new_tokens - (len(out) - len(prompt))
        draft = list(drafter(out))[: min(gamma, left - 1)]
        pred = model(torch.tensor([[out[-1]] + draft]), cache=cache)[0].argmax(-1).tolist()   # (1 + len(draft),)
        forwards += 1
        k = 0
        while k < len(draft) and draft[k] == pred[k]:
            k += 1
        out += draft[:k] + [draft[k] if _keep_rejected and k < len(draft) else pred[k]]
        cache.seqlens -= len(draft) - k                                   # forget the rejected drafts' keys
        accepted.append(k)
    return out, forwards, accepted


@torch.no_grad()
def jacobi_greedy(model: GPT, prompt: list[int], max_new_tokens: int, window: int,
                  pool: NgramPool | None = None) -> tuple[list[int], int]:
    """Jacobi decoding: (tokens, target forwards). Each iteration runs the whole sequence plus
    ``window`` guesses (no cache) and keeps the argmax up to the first wrong guess (at least one token).
    With a ``pool``, the window's guesses start from the pool's draft of the text so far (lookahead
    decoding would also harvest n-grams from the guesses themselves; that is not done here)."""
    if window < 1 or max_new_tokens < 1:
        raise ValueError(f"jacobi_greedy: window and max_new_tokens must be >= 1, got {window}, {max_new_tokens}")
    if len(prompt) + max_new_tokens + window > model.config.block_size:
        raise ValueError(f"jacobi_greedy: {len(prompt)} + {max_new_tokens} + window={window} tokens exceed "
                         f"block_size={model.config.block_size}")
    out = list(prompt)
    guess = [out[-1]] * window
    forwards = 0
    while len(out) - len(prompt) < max_new_tokens:
        if pool is not None:
            drafted = pool.draft(out, window)
            guess = drafted + guess[len(drafted):]
        L = len(out)
        new = model(torch.tensor([out + guess]))[0, L - 1: L - 1 + window].argmax(-1).tolist()  # (window,)
        forwards += 1
        k = 0                                   # new[i] is final iff guess[:i] == new[:i]
        while k + 1 < window and guess[k] == new[k]:
            k += 1
        out += new[: k + 1]
        guess = new[k + 1:] + [new[-1]] * (k + 1)
    return out[: len(prompt) + max_new_tokens], forwards


def truncated_copy(model: GPT, n_layer: int) -> GPT:
    """A draft model: the target's first ``n_layer`` blocks, its final norm and its (tied) head."""
    from dataclasses import replace

    if not 1 <= n_layer <= model.config.n_layer:
        raise ValueError(f"truncated_copy: n_layer must be in [1, {model.config.n_layer}], got {n_layer}")
    draft = GPT(replace(model.config, n_layer=n_layer))
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("blocks.") or int(k.split(".")[1]) < n_layer}
    draft.load_state_dict(state)
    return draft.eval()
