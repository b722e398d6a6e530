"""kernels.attention.masks and kernels.model.padded: padding masks, positions, and the tiny GPT on left-padded batches."""
import copy

import kernels  # noqa: F401  (before triton)
import pytest
import torch

from kernels.attention.masks import pad_batch, positions_from_padding, visible_keys
from kernels.attention.mha import masked_attention_ref
from kernels.model import data, load_pretrained
from kernels.model.padded import forward_padded, generate_left_padded
from kernels.testing import MismatchError, assert_close

PROMPTS = ["ROMEO:\nBut soft", "KING:\nNow", "LADY MACBETH:\nOut, damned spot!", "A"]


@pytest.fixture(scope="module")
def model():
    return load_pretrained()


def test_pad_batch_left_and_right():
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([9])]
    ids, pad = pad_batch(seqs, pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]] and pad.tolist() == [[False] * 3, [True, True, False]]
    ids, pad = pad_batch(seqs, pad_id=0, side="right")
    assert ids.tolist() == [[5, 6, 7], [9, 0, 0]] and pad.tolist() == [[False] * 3, [False, True, True]]


def test_positions_start_at_each_first_real_token():
    _, pad = pad_batch([torch.arange(4), torch.arange(2), torch.arange(1)], side="left")
    assert positions_from_padding(pad).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1], [0, 0, 0, 0]]


def test_visible_keys_is_the_mask_masked_attention_applies():
    _, pad = pad_batch([torch.arange(5), torch.arange(3)], side="left")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    _, probs = masked_attention_ref(q, k, v, causal=True, key_padding_mask=pad, return_probs=True)
    assert torch.equal(probs[:, 0] > 0, visible_keys(pad))
    assert visible_keys(pad, causal=False)[1, 0].tolist() == [False, False, True, True, True]


def test_left_padded_batch_gives_each_prompt_alone(model):
    prompts = [data.encode(p) for p in PROMPTS]
    idx, pad = pad_batch(prompts, side="left")
    wide = copy.deepcopy(model).double()
    with torch.no_grad():
        batched = forward_padded(model, idx, pad)[:, -1]                      # (B, V) next-token logits
        alone = torch.stack([model(p[None])[0, -1] for p in prompts])         # fp32, one prompt at a time
        ref = torch.stack([wide(p[None])[0, -1] for p in prompts])            # the same, float64 weights
        # batching costs no more than twice the fp32 forward's own rounding
        assert_close(batched, ref, dtype=torch.float32, baseline=alone)


def test_padding_keys_left_visible_are_caught(model):
    """The broken variant: the pad mask forgotten (positions still right). The short prompts read pads."""
    prompts = [data.encode(p) for p in PROMPTS]
    idx, pad = pad_batch(prompts, side="left")
    with torch.no_grad():
        alone = torch.stack([model(p[None])[0, -1] for p in prompts])
        ref = torch.stack([copy.deepcopy(model).double()(p[None])[0, -1] for p in prompts])
        broken = forward_padded(model, idx, torch.zeros_like(pad), positions=positions_from_padding(pad))[:, -1]
    with pytest.raises(MismatchError):
        assert_close(broken, ref, dtype=torch.float32, baseline=alone)


def test_right_padding_last_column_is_wrong_gathered_is_right(model):
    prompts = [data.encode(p) for p in PROMPTS]
    idx, pad = pad_batch(prompts, side="right")
    lens = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        logits = forward_padded(model, idx, pad)
        alone = torch.stack([model(p[None])[0, -1] for p in prompts])
        ref = torch.stack([copy.deepcopy(model).double()(p[None])[0, -1] for p in prompts])
    assert_close(logits[torch.arange(len(prompts)), lens - 1], ref, dtype=torch.float32, baseline=alone)
    with pytest.raises(MismatchError):
        assert_close(logits[:, -1], ref, dtype=torch.float32, baseline=alone)


def test_generation_left_padded_equals_one_by_one(model):
    prompts = [data.encode(p) for p in PROMPTS[:3]]
    for p, got in zip(prompts, generate_left_padded(model, prompts, 5)):
        assert torch.equal(got, model.generate(p[None], 5, use_cache=False)[0])


def test_bad_input_refused(model):
    with pytest.raises(ValueError, match="side"):
        pad_batch([torch.arange(3)], side="middle")
    with pytest.raises(ValueError, match="non-empty"):
        pad_batch([torch.arange(0)])
    with pytest.raises(ValueError, match="pad"):
        positions_from_padding(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="pad"):
        visible_keys(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="idx"):
        forward_padded(model, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.bool))
