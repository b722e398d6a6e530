"""Drafters for the serving engine: speculative decoding served by ``kernels.serving.engine.Engine``.

``EngineConfig(speculative=PromptLookup(), num_draft=4)`` (or ``DraftModel(truncated_copy(model, 1))``)
makes every engine step, for each decoding sequence:

1. ``propose(tokens, k, params, keys)`` -> a draft d_1..d_k (k <= num_draft, fewer near max_tokens,
   possibly none) and its distributions q (k, V), or None for a deterministic draft (q one-hot);
2. one target run of the last token plus the k drafts, like a prefill chunk of k + 1 tokens in the
   step's batch (the scheduler reserves the k + 1 KV slots): k + 1 logits rows;
3. ``verify(logits, params, drafts, q, u, keys)`` -> n accepted and n + 1 tokens (the rule of
   :mod:`kernels.speculative.sampling`, :func:`verify_ref` or the Triton :func:`verify`);
4. the engine appends them and rolls back: the sequence's computed length becomes start + 1 + n, the
   pages past it go back (``Scheduler.rollback``); the rejected drafts' slots are overwritten later.

The target's distribution p is processed exactly as the plain sampler processes it
(:func:`kernels.serving.sampling.processed_probs_ref`: temperature, top-k, top-p, min-p), so the
output is distributed as plain sampling with the same parameters. A greedy request has p one-hot at
the argmax; with a one-hot q the rule then accepts d iff d = argmax, and the residual is the argmax:
greedy verification is the rule's special case, and the output equals plain greedy decoding.

A one-hot q (prompt lookup) is a valid proposal: accept d with probability min(1, p(d)/1) = p(d),
else draw from max(0, p - q) normalised = p without d, renormalised.

Randomness. The engine gives each draw its own Philox key from the request's seed, choice and token
index (``kernels.serving.engine.spec_key``, three streams: draft draws, acceptance uniforms u, the
residual draw), so a sampled request's answer depends only on its seed and on what it generated,
never on which requests share its batch.

Why the engine does not import this module: :mod:`kernels.speculative.sampling` imports the
serving sampler's Philox helpers, so an import the other way would make the packages
``kernels.serving`` and ``kernels.speculative`` import each other (tests/test_layout.py refuses
package cycles). The engine takes the drafter as an object, as it takes its KV cache as a factory.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction
from itertools import product

import torch

from kernels.model.gpt import GPT, KVCache
from kernels.serving.sampling import SamplingParams, _row_params, processed_probs_ref, sample_ref
from kernels.speculative.drafts import prompt_lookup
from kernels.speculative.sampling import RULES, verify, verify_ref

BROKEN = (None, "keep_rejected", "raw_p")


class Drafter:
    """The verification shared by every drafter; subclasses define :meth:`propose`.

    ``rule`` other than "exact" selects a wrong rule of kernels.speculative.sampling; ``broken`` a
    deliberately broken engine step, for the tests: "keep_rejected" emits the rejected draft instead
    of the target's token (caught by greedy equality), "raw_p" verifies against the softmax of the
    raw logits, ignoring temperature, top-k and top-p (caught by the chi-square)."""

    def __init__(self, *, rule: str = "exact", broken: str | None = None):
        if rule not in RULES:
            raise ValueError(f"{type(self).__name__}: rule must be one of {RULES}, got {rule!r}")
        if broken not in BROKEN:
            raise ValueError(f"{type(self).__name__}: broken must be one of {BROKEN}, got {broken!r}")
        self.rule, self.broken = rule, broken

    def propose(self, tokens: list[int], num_draft: int, params: SamplingParams,
                keys: list[int]) -> tuple[list[int], torch.Tensor | None]:
        raise NotImplementedError

    def verify(self, logits: torch.Tensor, params: list[SamplingParams], drafts: torch.Tensor,
               q: list[torch.Tensor | None], u: torch.Tensor, keys: torch.Tensor, *,
               use_kernels: bool = False, residual_u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, k+1, V) of the target at the last token and the k drafts, drafts (B, k) int64,
        q per sequence (k, V) or None (one-hot at its drafts), u (B, k), keys (B,) ->
        (n (B,) int32 accepted, tokens (B, k+1): the n drafts, the next token, then -1).
        ``residual_u`` (B, V) float64 replaces the keys' uniforms of the last draw (reference only:
        :func:`engine_step_distribution` chooses them)."""
        B, G1, V = logits.shape
        if use_kernels and residual_u is not None:
            raise ValueError(f"{type(self).__name__}.verify: residual_u is for the reference (use_kernels=False)")
        rows = [p for p in params for _ in range(G1)]
        if self.broken == "raw_p":
            p = torch.softmax(logits.float(), -1)                                        # broken: unprocessed
        else:
            p = processed_probs_ref(logits.reshape(B * G1, V), rows).view(B, G1, V)     # (B, k+1, V)
        one_hot = torch.nn.functional.one_hot(drafts, V).float()                         # (B, k, V)
        qq = torch.stack([one_hot[b] if qb is None else qb.float() for b, qb in enumerate(q)])
        if use_kernels:
            n, tokens = verify(p.contiguous(), qq.contiguous(), drafts, u, keys, rule=self.rule)
        else:
            n, tokens = verify_ref(p.contiguous(), qq.contiguous(), drafts, u, keys, rule=self.rule,
                                   residual_u=residual_u)
        if self.broken == "keep_rejected":
            rejected = n < drafts.shape[1]
            at = torch.arange(B)[rejected]
            tokens[at, n[rejected].long()] = drafts[at, n[rejected].long()]              # broken: the draft kept
        return n, tokens


class PromptLookup(Drafter):
    """Prompt-lookup drafts (:func:`kernels.speculative.drafts.prompt_lookup`): deterministic, q one-hot."""

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1, **kw):
        super().__init__(**kw)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens, num_draft, params, keys):
        return prompt_lookup(tokens, num_draft, max_ngram=self.max_ngram, min_ngram=self.min_ngram), None


class DraftModel(Drafter):
    """A small model's drafts, each drawn from q_j = its next-token distribution after the tokens and
    the drafts before, processed with the request's own parameters (greedy: its argmax; q one-hot).
    The draw is the plain sampler's (Gumbel-max on Philox uniforms) with the engine's key for that
    position. The draft model keeps no cache between steps: each proposal prefills the sequence into
    a fresh contiguous KV cache, then decodes k - 1 tokens (the simple choice; a server would keep
    the draft's cache and roll it back as the target's)."""

    def __init__(self, model: GPT, **kw):
        super().__init__(**kw)
        if not isinstance(model, GPT):
            raise TypeError(f"DraftModel: model must be a kernels.model.gpt.GPT, got {type(model).__name__}")
        self.model = model.eval()

    @torch.no_grad()
    def propose(self, tokens, num_draft, params, keys):
        t, k, tp, mp = _row_params([params])
        cache = KVCache.empty(self.model.config, 1)
        x, draft, qs = torch.tensor([tokens]), [], []
        for j in range(num_draft):
            logits = self.model(x, cache=cache)[0, -1:].float()                          # (1, V)
            if params.greedy:                                                            # q one-hot at the argmax
                d = int(logits[0].argmax())
            else:
                d = int(sample_ref(logits, t, k, tp, mp, torch.tensor([keys[j]], dtype=torch.int64))[0][0, 0])
                qs.append(processed_probs_ref(logits, [params])[0])                      # (V,) what d was drawn from
            draft.append(d)
            x = torch.tensor([[d]])
        return draft, (torch.stack(qs) if qs else None)


# ---------------------------------------------------------------- the engine's verification, enumerated exactly

def toy_table(seed: int, vocab: int = 3, total: int = 6):
    """prefix (tuple) -> a distribution over ``vocab`` tokens with weights in multiples of 1/``total``
    (some exactly zero), as Fractions: every ratio p(x)/q(x) of two such tables has a denominator
    dividing lcm(1..total), so a grid of that many acceptance uniforms integrates the rule exactly."""
    r, cache = random.Random(seed), {}

    def fn(prefix):
        if prefix not in cache:
            cuts = sorted(r.randint(0, total) for _ in range(vocab - 1))
            w = [b - a for a, b in zip([0] + cuts, cuts + [total])]
            cache[prefix] = [Fraction(x, total) for x in w]
        return cache[prefix]
    return fn


def _drafts(q_fn, prefix: tuple, gamma: int, vocab: int) -> list[tuple[tuple, Fraction]]:
    """Every draft d_1..d_gamma the drafter can draw, with its probability prod_j q_j(d_j)."""
    out = []
    for d in product(range(vocab), repeat=gamma):
        w = math.prod(q_fn(prefix + d[:j])[d[j]] for j in range(gamma))
        if w:
            out.append((d, w))
    return out


def _grid_size(p_fn, q_fn, prefix: tuple, drafts: list) -> int:
    """N such that every acceptance threshold p_j(d_j)/q_j(d_j) < 1 is a multiple of 1/N: then the N
    midpoint uniforms (i + 1/2)/N of each position accept in exactly the fraction min(1, p/q)."""
    n = 1
    for d, _ in drafts:
        for j in range(len(d)):
            a = p_fn(prefix + d[:j])[d[j]] / q_fn(prefix + d[:j])[d[j]]
            if a < 1:
                n = math.lcm(n, a.denominator)
    return n


def _last_token_distribution(call, rows: torch.Tensor, at: torch.Tensor, vocab: int, *,
                             iters: int = 40, floor: float = 1e-9) -> torch.Tensor:
    """The distribution the verification ``call`` draws the token at position ``at`` (R,) from, for
    its rows (R,), read off the Gumbel-max draw itself: with uniforms u_i = exp(-E_i) the draw is
    argmin_i E_i / r_i (the exponential race), so E = 1 everywhere finds the largest r_a, and
    E_a = 1, E_k = rho, E_other = inf (u = 0) picks k iff rho < r_k / r_a: a bisection in log rho
    (all k at once) down to ``floor``, below which a ratio counts as 0. (R, V) float64."""
    R = rows.numel()
    ones = torch.ones(R, vocab, dtype=torch.float64)
    a = call(rows, torch.exp(-ones))[1][torch.arange(R), at]             # (R,) argmax_i r_i
    rr, aa, kk = rows.repeat_interleave(vocab), a.repeat_interleave(vocab), torch.arange(vocab).repeat(R)
    at_rk, ar = at.repeat_interleave(vocab), torch.arange(R * vocab)

    def wins(log_rho):                                                   # (R*V,) does k beat a at rho?
        E = torch.full((R * vocab, vocab), float("inf"), dtype=torch.float64)
        E[ar, aa] = 1.0
        E[ar, kk] = torch.where(aa == kk, 1.0, torch.exp(log_rho))
        return call(rr, torch.exp(-E))[1][ar, at_rk] == kk

    lo = torch.full((R * vocab,), math.log(floor), dtype=torch.float64)
    hi = torch.zeros(R * vocab, dtype=torch.float64)
    alive = wins(lo) | (aa == kk)                                        # r_k / r_a >= floor
    for _ in range(iters):
        mid = (lo + hi) / 2
        w = wins(mid)
        lo, hi = torch.where(w, mid, lo), torch.where(w, hi, mid)
    ratio = torch.where(aa == kk, 1.0, torch.where(alive, torch.exp(lo), 0.0)).view(R, vocab)
    return ratio / ratio.sum(1, keepdim=True)


def engine_step_distribution(drafter: Drafter, p_fn, q_fn, prefix: tuple, gamma: int,
                             params: SamplingParams) -> dict:
    """The distribution (float64) of what one speculative step emits, computed *through*
    ``drafter.verify`` (the engine's verification: processed p, the drafter's q, the acceptance test,
    the residual draw): the drafts are enumerated with their probabilities under q_fn, the acceptance
    uniforms on a grid that integrates the rule exactly (:func:`_grid_size`), and the last token's
    distribution is read off the draw (:func:`_last_token_distribution`). The target's logits are
    T log p_fn, so that p processed at ``params``' temperature T is p_fn again (float32)."""
    vocab = len(p_fn(prefix))
    drafts = _drafts(q_fn, prefix, gamma, vocab)
    N = _grid_size(p_fn, q_fn, prefix, drafts)
    cells = list(product(range(N), repeat=gamma))
    T = params.temperature

    def table(fn, d, j):                                            # (V,) float64 of fn after prefix + d_<j
        return torch.tensor([float(x) for x in fn(prefix + d[:j])], dtype=torch.float64)
    logits = torch.stack([torch.stack([T * table(p_fn, d, j).log() for j in range(gamma + 1)]) for d, _ in drafts])
    qs = torch.stack([torch.stack([table(q_fn, d, j) for j in range(gamma)]) for d, _ in drafts])
    u = (torch.tensor(cells, dtype=torch.float64) + 0.5) / N                        # (C, gamma) midpoints
    D, C = len(drafts), len(cells)
    draft_of = torch.arange(D).repeat_interleave(C)                                 # rows: draft-major

    def call(rows, residual_u):                                     # verify rows (R,) -> (n (R,), tokens (R, k+1))
        di, ci = draft_of[rows], rows % C
        dr = torch.tensor([drafts[i][0] for i in di.tolist()], dtype=torch.int64).view(-1, gamma)
        n, tokens = drafter.verify(logits[di].float(), [params] * rows.numel(), dr,
                                   [qs[i].float() for i in di.tolist()], u[ci].float(),
                                   torch.zeros(rows.numel(), dtype=torch.int64), residual_u=residual_u)
        return n, tokens

    n, tokens = call(torch.arange(D * C), torch.full((D * C, vocab), math.exp(-1), dtype=torch.float64))
    groups: dict = {}                                               # (draft, n) -> rows
    for row, (di, nb) in enumerate(zip(draft_of.tolist(), n.tolist())):
        groups.setdefault((di, nb), []).append(row)
    reps = torch.tensor([rows[0] for rows in groups.values()])
    at = torch.tensor([nb for _, nb in groups])
    last = _last_token_distribution(call, reps, at, vocab)                # (groups, V)
    out: dict = {}
    for g, ((di, nb), rows) in enumerate(groups.items()):
        head = tuple(tokens[rows[0], :nb].tolist())
        w = float(drafts[di][1]) * len(rows) / C
        for x in range(vocab):
            if last[g, x] > 0:
                out[head + (x,)] = out.get(head + (x,), 0.0) + w * float(last[g, x])
    return out
