"""kernels.rl.task and kernels.rl.sft: the template, the loss mask, packing, and the committed SFT runs."""
import json

import pytest
import torch

from kernels.model.gpt import load_pretrained
from kernels.rl import sft, task


def test_template_and_reward():
    assert bytes(task.render(7, 45, "52")) == b"\x0107+45\x0252\x03"
    assert len(task.render(99, 99)) == task.PROMPT_LEN
    comp = torch.tensor([list(b"52\x03\x03"), list(b"52\x03x"), list(b"520\x03"), list(b"5252")])
    pairs = torch.tensor([[7, 45]] * 4)
    assert task.rewards(comp, pairs).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert task.completion_mask(comp).tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match=r"operands must be in \[0, 100\)"):
        task.render(100, 1)


def test_held_out_pairs_are_disjoint_from_training():
    train, held = task.split_pairs()
    assert len(train) == 9500 and len(held) == 500
    seen = {tuple(p) for p in train.tolist()}
    assert not any(tuple(p) in seen for p in held.tolist())


def test_loss_mask_keeps_only_the_answer():
    x, y = sft.example(7, 45)
    kept = y[y != sft.IGNORE]
    assert bytes(kept.tolist()) == b"52\x03"
    _, y_all = sft.example(7, 45, mask_prompt=False)
    assert torch.equal(y_all, torch.tensor(task.render(7, 45, "52"))[1:])


def test_packing_resets_positions_and_numbers_examples():
    ex = [sft.example(a, b) for a, b in [(3, 4), (57, 88), (12, 9), (99, 99)]]
    p = sft.pack(ex, 32)
    assert p["ids"].shape == (2, 32)
    assert p["positions"][0, :10].tolist() == list(range(8)) + [0, 1]
    assert int((p["targets"] != sft.IGNORE).sum()) == sum(int((y != sft.IGNORE).sum()) for _, y in ex)
    with pytest.raises(ValueError, match="exceeds block_size"):
        sft.pack(ex, 5)


def test_packed_forward_equals_each_example_alone():
    model = load_pretrained()
    ex = [sft.example(a, b) for a, b in [(3, 4), (57, 88), (12, 9)]]
    p = sft.pack(ex, 40)
    with torch.no_grad():
        packed = sft.packed_forward(model, p["ids"], p["positions"], sft.packed_mask(p["seq"]))
        no_mask = sft.packed_forward(model, p["ids"], p["positions"], torch.ones(40, 40, dtype=torch.bool).tril()[None])
        for k, (x, _) in enumerate(ex):
            sel = p["seq"][0] == k
            alone = model(x[None])[0]
            assert float((packed[0, sel] - alone).abs().max()) < 1e-4
        # without the block-diagonal mask the second example sees the first: a different answer
        sel = p["seq"][0] == 1
        assert float((no_mask[0, sel] - model(ex[1][0][None])[0]).abs().max()) > 1e-2


@pytest.mark.parametrize("name,mask", [("sft", True), ("sft-nomask", False)])
def test_committed_sft_run_reproduces_its_first_steps(name, mask):
    """Re-run 3 steps of the committed run (same seed, one thread) and compare the logged losses."""
    log = sft.read_log(sft.OUT_DIR / name / "log.csv")
    meta = json.loads((sft.OUT_DIR / name / "metrics.json").read_text())
    threads = torch.get_num_threads()
    try:
        rerun = sft.train_sft(None, steps=meta["steps"], mask_prompt=mask, progress=False, stop_after=3)["log"]
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(rerun[1:4], log[1:4]):
        assert abs(got["loss"] - want["loss"]) < 1e-3 * max(1.0, want["loss"]), (got, want)
        assert abs(got["answer_loss"] - want["answer_loss"]) < 1e-3 * max(1.0, want["answer_loss"])


def test_committed_sft_checkpoint_scores_its_recorded_accuracy():
    meta = json.loads((sft.OUT_DIR / "sft" / "metrics.json").read_text())
    _, held = task.split_pairs()
    acc = task.accuracy(sft.load_sft(), held)
    assert abs(acc - meta["held_out_accuracy"]) <= 0.01     # 5 of 500 answers may flip on another CPU
    assert (sft.OUT_DIR / "sft" / "model.pt").stat().st_size < 2_000_000


def test_multi_turn_mask_scores_every_assistant_turn_only():
    x, y = sft.multi_turn_example([(7, 45)])
    x1, y1 = sft.example(7, 45)
    assert torch.equal(x, x1) and torch.equal(y, y1)                 # one turn is the single-turn example
    x, y = sft.multi_turn_example([(7, 45), (99, 1)])
    assert bytes(y[y != sft.IGNORE].tolist()) == b"52\x03100\x03"    # both answers and both ENDs, no user byte
    _, y_all = sft.multi_turn_example([(7, 45), (99, 1)], mask_prompt=False)
    assert (y_all != sft.IGNORE).all()


def test_cu_seqlens_are_the_packed_examples_boundaries():
    examples = [sft.example(a, b) for a, b in [(3, 4), (57, 88), (12, 9), (99, 99), (1, 2)]]
    packed = sft.pack(examples, 40)
    cu, longest = sft.cu_seqlens(packed["seq"])
    lengths = [len(x) for x, _ in examples]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert longest == max(lengths)


def test_answer_normalised_loss_gives_answers_the_masked_weight():
    """Scoring the prompt but dividing by the answer targets: each answer logit's gradient equals the
    masked loss's; with the prompt masked the two losses are equal."""
    b = sft.batch(task.split_pairs()[0], 6, torch.Generator().manual_seed(0), 64, mask_prompt=False)
    logits = torch.randn(*b["ids"].shape, 256, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g_norm, = torch.autograd.grad(sft.answer_normalised_loss(logits, b["targets"], b["answer"]), logits)
    g_mask, = torch.autograd.grad(sft.masked_loss(logits, b["answer"]), logits)
    on_answer = b["answer"] != sft.IGNORE
    assert torch.allclose(g_norm[on_answer], g_mask[on_answer], atol=1e-7)
    assert torch.allclose(sft.answer_normalised_loss(logits, b["answer"], b["answer"]), sft.masked_loss(logits, b["answer"]))
    g_tokens, = torch.autograd.grad(sft.masked_loss(logits, b["targets"]), logits)
    assert not torch.allclose(g_tokens[on_answer], g_mask[on_answer], atol=1e-7)   # the per-token mean dilutes them
