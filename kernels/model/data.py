"""The tiny GPT's text, tokenizer and batches.

The tokenizer is the identity on UTF-8 bytes: token id = byte value, vocabulary 256. For a model of
about a million parameters trained for minutes on a CPU that is the honest choice: it has no
training of its own, encodes any string with no unknown token, and puts all of the model's
capacity into the one thing a model this size can learn (spelling, punctuation, speaker turns). A
subword tokenizer (GPT-2's has 50,257 entries) would make the embedding table alone dozens of times
larger than the whole model. The price is length: one token per character, so a context of 128
tokens is only a few lines of verse.

Batches follow the language-modelling recipe: pick random windows of ``block_size + 1`` tokens; the
input is the first ``block_size`` of them, the target the same window shifted left by one, so the
model at position ``t`` is trained to predict token ``t + 1`` having seen tokens ``0..t``.
"""
from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TEXT_PATH = ROOT / "data" / "shakespeare" / "tragedies.txt"
VOCAB_SIZE = 256
VAL_FRACTION = 0.1


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor of token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids) -> str:
    """Token ids back to text (invalid UTF-8 sequences show as U+FFFD)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_text(path: Path = TEXT_PATH) -> str:
    return Path(path).read_text(encoding="utf-8")


def train_val_split(tokens: torch.Tensor, val_fraction: float = VAL_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``1 - val_fraction`` of the tokens train, the rest validate (no shuffling: the
    validation text is the end of the last play, never seen in training)."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


def get_batch(tokens: torch.Tensor, batch_size: int, block_size: int,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs x (B, T) and targets y (B, T) with y[:, t] = x[:, t + 1]."""
    if len(tokens) < block_size + 1:
        raise ValueError(f"get_batch: need at least block_size + 1 = {block_size + 1} tokens, got {len(tokens)}")
    starts = torch.randint(0, len(tokens) - block_size, (batch_size,), generator=generator)
    window = torch.stack([tokens[s: s + block_size + 1] for s in starts.tolist()])  # (B, T + 1)
    return window[:, :-1], window[:, 1:]


def fixed_windows(tokens: torch.Tensor, n_windows: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n_windows`` non-overlapping windows of ``tokens``: a deterministic evaluation slice."""
    need = n_windows * block_size + 1
    if len(tokens) < need:
        raise ValueError(f"fixed_windows: need {need} tokens, got {len(tokens)}")
    x = tokens[: n_windows * block_size].view(n_windows, block_size)
    y = tokens[1: n_windows * block_size + 1].view(n_windows, block_size)
    return x, y
