"""Around the LM-head loss: perplexity, soft targets (distillation), and the token mean under
gradient accumulation. PyTorch references, each small; the fused kernel's own extra terms (z-loss,
soft-capping) live in :mod:`kernels.model.lm_head`.

- Perplexity is exp of the mean loss in nats per token. A byte-level model's token is a byte; a
  model with a tokenizer spreads the same text's nats over fewer tokens, so only nats (or bits)
  per byte compare models with different tokenizers.
- Soft targets (Hinton, Vinyals and Dean 2015): the student's cross-entropy against a teacher's
  distribution p = softmax(t / T) instead of a one-hot target; it equals KL(p || q) plus the
  teacher's entropy (a constant for the student), and its gradient in the student's logits s is
  (q - p) / T, q = softmax(s / T); multiplying the loss by T^2 keeps the gradient's scale as T grows.
- Gradient accumulation: a step over micro-batches must divide the summed token losses by the
  number of non-ignored tokens in the whole step; the mean of per-micro-batch means is a different
  weighting whenever the micro-batches hold different numbers of such tokens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LN2 = math.log(2.0)


def perplexity(nats_per_token: float) -> float:
    """exp(mean loss in nats per token): the size of a uniform choice that would be as surprising."""
    return math.exp(nats_per_token)


def bits_per_byte(total_nats: float, n_bytes: int) -> float:
    """A text's total loss (nats, summed over its tokens, however they were cut) in bits per byte of text."""
    if n_bytes < 1:
        raise ValueError(f"bits_per_byte: n_bytes must be >= 1, got {n_bytes}")
    return total_nats / n_bytes / LN2


def soft_target_cross_entropy_ref(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                  temperature: float = 1.0) -> torch.Tensor:
    """Mean over rows of T^2 * H(p, q) = -T^2 sum_j p_j log q_j, with p = softmax(teacher / T) and
    q = softmax(student / T); logits (..., V). The teacher gets no gradient."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"soft_target_cross_entropy_ref: student_logits {tuple(student_logits.shape)} and "
                         f"teacher_logits {tuple(teacher_logits.shape)} must have the same shape")
    if not temperature > 0:
        raise ValueError(f"soft_target_cross_entropy_ref: temperature must be > 0, got {temperature}")
    V = student_logits.shape[-1]
    p = torch.softmax(teacher_logits.detach().reshape(-1, V) / temperature, -1)     # (N, V)
    log_q = torch.log_softmax(student_logits.reshape(-1, V) / temperature, -1)      # (N, V)
    return -(p * log_q).sum(-1).mean() * temperature ** 2


def distillation_kl_ref(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """The same objective written as T^2 KL(p || q) = T^2 sum_j p_j (log p_j - log q_j), mean over rows;
    it is the soft-target cross-entropy minus T^2 times the teacher's (constant) entropy."""
    V = student_logits.shape[-1]
    log_p = torch.log_softmax(teacher_logits.detach().reshape(-1, V) / temperature, -1)
    log_q = torch.log_softmax(student_logits.reshape(-1, V) / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean() * temperature ** 2


def accumulate_head_gradient(weight: torch.Tensor, micro_batches, *, normalize: str,
                             ignore_index: int = -100) -> torch.Tensor:
    """The gradient one accumulation step leaves on an LM head ``weight`` (V, C): for each micro-batch
    (hidden (n_i, C), targets (n_i,)) the loss of logits hidden @ weight^T is back-propagated and the
    gradients add up, as in a training loop that steps once after all of them.

    normalize="micro_mean": each micro-batch's mean over its own non-ignored tokens, divided by the
    number of micro-batches (the common loop, and the pitfall). normalize="global": each micro-batch's
    sum, divided by the non-ignored tokens of the whole step (the mean over tokens)."""
    if normalize not in ("micro_mean", "global"):
        raise ValueError(f"accumulate_head_gradient: normalize must be 'micro_mean' or 'global', got {normalize!r}")
    w = weight.detach().clone().requires_grad_()
    n_step = sum(int((y != ignore_index).sum()) for _, y in micro_batches)      # tokens that count, whole step
    for h, y in micro_batches:
        logits = h @ w.T                                                          # (n_i, V)
        if normalize == "micro_mean":
            loss = F.cross_entropy(logits, y, ignore_index=ignore_index) / len(micro_batches)
        else:
            loss = F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum") / n_step
        loss.backward()                                                           # w.grad += dloss/dw
    return w.grad
