"""The verifiable task of this part: byte-level addition, with a chat template, a reward and a held-out set.

A prompt asks for a + b with two-digit operands written with a leading zero (so that every prompt
has the same length, 7 bytes, and a batch of prompts needs no padding); the answer is the sum in
decimal followed by an end-of-turn byte:

    \\x01 07+45 \\x02 52 \\x03        (spaces added here for reading; the bytes are contiguous)

The three control bytes \\x01 (user), \\x02 (assistant), \\x03 (end of turn) never occur in the
Shakespeare text the tiny GPT was trained on (kernels.model.data), so they are free to serve as the
template's special tokens, the way a chat model's tokenizer adds <|im_start|>-like tokens.

The reward is verifiable: 1 if the completion, cut at its first end-of-turn byte, is exactly the
decimal sum, else 0 (a completion without an end-of-turn byte scores 0). Of the 10,000 operand pairs,
a fixed random 500 are held out from every training run (SFT, GRPO, PPO, DPO) and score the models.
"""
from __future__ import annotations

import torch

from kernels.model.gpt import GPT

USER, ASSISTANT, END = 1, 2, 3          # byte ids of the template's special tokens
PROMPT_LEN = 7                           # \x01 a a + b b \x02
MAX_ANSWER = 4                           # up to three digits (99 + 99 = 198) and the end-of-turn byte
N_HELD_OUT = 500
SPLIT_SEED = 0


def prompt_text(a: int, b: int) -> str:
    """The user's turn for a + b, operands zero-padded to two digits."""
    if not (0 <= a < 100 and 0 <= b < 100):
        raise ValueError(f"prompt_text: operands must be in [0, 100), got {a} and {b}")
    return f"{a:02d}+{b:02d}"


def render(a: int, b: int, answer: str | None = None) -> list[int]:
    """The chat template as byte ids: user turn, assistant marker, and (when given) the answer and END."""
    ids = [USER, *prompt_text(a, b).encode(), ASSISTANT]
    if answer is not None:
        ids += [*answer.encode(), END]
    return ids


def split_pairs(n_held_out: int = N_HELD_OUT, seed: int = SPLIT_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """All 10,000 (a, b) pairs in a fixed random order: (train (9500, 2), held_out (500, 2))."""
    grid = torch.cartesian_prod(torch.arange(100), torch.arange(100))          # (10000, 2)
    order = torch.randperm(len(grid), generator=torch.Generator().manual_seed(seed))
    return grid[order[n_held_out:]], grid[order[:n_held_out]]


def prompts(pairs: torch.Tensor) -> torch.Tensor:
    """Prompt ids (P, PROMPT_LEN) for operand pairs (P, 2)."""
    return torch.tensor([render(int(a), int(b)) for a, b in pairs.tolist()], dtype=torch.long)


def completion_mask(completions: torch.Tensor) -> torch.Tensor:
    """1.0 on the tokens up to and including the first END of each row (all of a row without END): (B, L)."""
    is_end = completions == END
    before = torch.cumsum(is_end.long(), dim=1) - is_end.long()                 # ENDs strictly before t
    return (before == 0).float()


def rewards(completions: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """1.0 where the completion (B, L), cut at its first END, is the decimal sum of its pair (B, 2)."""
    out = torch.zeros(len(completions))
    for i, (row, (a, b)) in enumerate(zip(completions.tolist(), pairs.tolist())):
        if END in row:
            out[i] = float(bytes(row[: row.index(END)]) == str(a + b).encode())
    return out


@torch.no_grad()
def sample(model: GPT, pairs: torch.Tensor, *, temperature: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Completions (B, MAX_ANSWER) for the pairs (B, 2): sampled at ``temperature``, greedy at 0."""
    was_training = model.training
    model.eval()
    out = model.generate(prompts(pairs), MAX_ANSWER, temperature=temperature, generator=generator)
    model.train(was_training)
    return out[:, PROMPT_LEN:]


def accuracy(model: GPT, pairs: torch.Tensor) -> float:
    """Mean reward of greedy answers on ``pairs`` (the held-out score)."""
    return float(rewards(sample(model, pairs, temperature=0.0), pairs).mean())


def completion_logprobs(model: GPT, completions: torch.Tensor, pairs: torch.Tensor, *,
                        use_kernel: bool = False) -> torch.Tensor:
    """log pi(c_t | prompt, c_<t) for every completion token: (B, MAX_ANSWER), differentiable.

    One forward over prompt + completion minus its last token; the hidden state at position
    PROMPT_LEN - 1 + t predicts completion token t. ``use_kernel`` takes the log-probs with
    kernels.rl.logprobs.fused_linear_token_logprobs instead of a full log-softmax."""
    seqs = torch.cat([prompts(pairs), completions], dim=1)                      # (B, P + L)
    hidden = model(seqs[:, :-1], return_hidden=True)[:, PROMPT_LEN - 1:]        # (B, L, C)
    if use_kernel:
        from kernels.rl.logprobs import fused_linear_token_logprobs
        return fused_linear_token_logprobs(hidden, model.wte.weight, completions)
    logits = hidden @ model.wte.weight.T                                        # (B, L, V)
    return torch.log_softmax(logits, -1).gather(-1, completions[..., None]).squeeze(-1)
