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
               use_kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, k+1, V) of the target at the last token and the k drafts, drafts (B, k) int64,
        q per sequence (k, V) or None (one-hot at its drafts), u (B, k), keys (B,) ->
        (n (B,) int32 accepted, tokens (B, k+1): the n drafts, the next token, then -1)."""
        B, G1, V = logits.shape
        rows = [p for p in params for _ in range(G1)]
        if self.broken == "raw_p":
            p = torch.softmax(logits.float(), -1)                                        # broken: unprocessed
        else:
            p = processed_probs_ref(logits.reshape(B * G1, V), rows).view(B, G1, V)     # (B, k+1, V)
        one_hot = torch.nn.functional.one_hot(drafts, V).float()                         # (B, k, V)
        qq = torch.stack([one_hot[b] if qb is None else qb.float() for b, qb in enumerate(q)])
        check = verify if use_kernels else verify_ref
        n, tokens = check(p.contiguous(), qq.contiguous(), drafts, u, keys, rule=self.rule)
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
