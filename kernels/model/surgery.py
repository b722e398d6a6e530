"""Checkpoint surgery on the tiny GPT: change how many K/V heads it has, keeping its other weights.

Grouped-query attention (Ainslie et al. 2023) converts a multi-head checkpoint by mean-pooling the
key and value projection heads of each group (:func:`kernels.attention.gqa.mean_pool_kv_heads`);
:func:`pool_gpt_kv_heads` applies that to every layer of a :class:`kernels.model.gpt.GPT`.
:func:`repeat_gpt_kv_heads` goes the other way (GQA to MHA) and is exact: every query head keeps
reading the same K/V.
"""
from __future__ import annotations

import copy

from kernels.attention.gqa import mean_pool_kv_heads
from kernels.model.gpt import GPT, GPTConfig


def with_kv_heads(model: GPT, n_kv_head: int, transform) -> GPT:
    """A copy of ``model`` with ``n_kv_head`` K/V heads, each K and V projection weight passed through ``transform``."""
    cfg = model.config
    new_cfg = GPTConfig(**{**cfg.__dict__, "n_kv_head": n_kv_head})
    new = GPT(new_cfg)
    state = copy.deepcopy(model.state_dict())
    for name in list(state):
        if name.endswith("attn.wk.weight") or name.endswith("attn.wv.weight"):
            state[name] = transform(state[name])
    new.load_state_dict(state)
    return new.eval()


def pool_gpt_kv_heads(model, n_kv_head: int):
    """A copy of a tiny GPT with its K/V heads mean-pooled down to ``n_kv_head`` (no retraining)."""
    old = model.config.n_kv_head
    return with_kv_heads(model, n_kv_head, lambda w: mean_pool_kv_heads(w, old, n_kv_head))


def repeat_gpt_kv_heads(model, n_kv_head: int):
    """A copy with each K/V head repeated so there are ``n_kv_head`` (e.g. GQA -> MHA); the function is unchanged."""
    old = model.config.n_kv_head
    if n_kv_head % old or n_kv_head > model.config.n_head:
        raise ValueError(f"repeat_gpt_kv_heads: n_kv_head={n_kv_head} must be a multiple of {old} and <= n_head")
    rep = n_kv_head // old

    def transform(w):
        D = w.shape[0] // old
        return w.reshape(old, 1, D, w.shape[1]).expand(old, rep, D, w.shape[1]).reshape(n_kv_head * D, w.shape[1])

    return with_kv_heads(model, n_kv_head, transform)
