"""The live-tensor tracker (kernels.tensor_memory.TensorPeak) on sequences whose answer is known byte for byte,
two broken trackers that those sequences catch, and one training step of a small GPT measured by
kernels.model.step_memory against an independent count of its activations."""
import importlib

import pytest
import torch

from kernels.tensor_memory import TensorPeak
from kernels.model import data
from kernels.model.gpt import GPT, GPTConfig
from kernels.model.step_memory import saved_activation_bytes, step_memory
from kernels.model.train import param_groups, train_step


def alloc_free_view(probe_cls, track=()):
    """4000 B made, 2000 B more, the first freed while 2000 B are made, then a free view: the timeline
    must be [4000, 6000, 4000, 4000] (+ tracked bytes), peak at index 1."""
    with probe_cls(track=track) as probe:
        a = torch.empty(1000)                     # 4000 B
        b = torch.empty(500)                      # 6000 B alive
        del a
        c = b * 2                                 # a is gone: b + c = 4000 B
        view = c[::2]                             # a view: no new memory
    return probe, (b, c, view)


class NeverFrees(TensorPeak):
    """Broken: counts a storage until the end, as a tracker of allocations alone would."""

    def _alive(self, ref):
        return True


class ViewsAreNew(TensorPeak):
    """Broken: counts every output's storage, views and in-place results included, as new memory."""

    def _observe(self, out, inputs):
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() in inputs:
            self._live[-len(self.timeline) - 1] = (self._live[out.untyped_storage().data_ptr()][0],
                                                   out.untyped_storage().nbytes())
        super()._observe(out, inputs)


def test_timeline_peak_and_frees_are_exact():
    probe, _ = alloc_free_view(TensorPeak)
    assert probe.timeline == [4000, 6000, 4000, 4000]
    assert (probe.peak_bytes, probe.peak_index) == (6000, 1)


def test_the_broken_trackers_are_caught():
    never, _ = alloc_free_view(NeverFrees)
    assert never.timeline != [4000, 6000, 4000, 4000] and never.timeline[2] == 8000      # a's free missed
    views, _ = alloc_free_view(ViewsAreNew)
    assert views.timeline != [4000, 6000, 4000, 4000] and views.timeline[3] == 6000       # the view counted


def test_tracked_tensors_count_and_their_frees_are_seen():
    pre = torch.empty(250)                                    # 1000 B made before the block
    with TensorPeak(track=[pre]) as probe:
        x = pre + 1                                           # 2000 B
        probe.mark("first")
        del pre
        y = x[:10].clone()                                    # the slice: pre freed (1000 B); + y = 1040 B
    assert probe.timeline == [2000, 1000, 1040] and probe.marks == [("first", 1)]
    assert probe.bytes_at_peak([x]) == 1000 and probe.bytes_at_peak([y]) == 0
    with TensorPeak() as untracked:
        z = x + 1
    assert untracked.timeline == [1000] and z.numel() == 250  # x, made before, is not counted untracked


SMALL = GPTConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96, block_size=32)


def _model_and_batch(foreach):
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), foreach=foreach)
    tokens = data.encode(data.load_text()[:20_000])
    x, y = data.get_batch(tokens, 3, SMALL.block_size, torch.Generator().manual_seed(0))
    return model, opt, x, y


@pytest.mark.parametrize("foreach", [False, True])
def test_a_training_step_against_the_ledger(foreach):
    model, opt, x, y = _model_and_batch(foreach)
    with pytest.raises(ValueError, match="take one step first"):
        step_memory(model, opt, x, y)
    train_step(model, opt, x, y)
    mem = step_memory(model, opt, x, y)
    n_bytes = sum(p.nbytes for p in model.parameters())
    assert mem.params == mem.previous_grads == n_bytes and mem.state == 2 * n_bytes + 4 * len(opt.state)
    assert sum(mem.at_peak.values()) == mem.peak_bytes and list(mem.phases) == ["forward", "backward", "clip",
                                                                                "optimizer"]
    # the recipe drops the previous gradients after its forward: the peak is the forward's end, where the
    # ledger's every entry is alive, and the rest is exactly what autograd saved plus the logits and the loss
    acts = saved_activation_bytes(model, x, y)
    assert mem.peak_phase == "forward" and mem.peak_index == mem.phases["forward"] - 1
    assert mem.at_peak["gradients (previous step)"] == n_bytes and mem.at_peak["gradients (this step)"] == 0
    assert mem.at_peak["activations, logits, temporaries"] == acts["saved"] + acts["logits"] + acts["loss"]
    # the optimizer's temporaries: foreach, one list the size of the larger parameter group; the for-loop,
    # sqrt(v) and its quotient for one parameter (and the previous parameter's quotient, still bound)
    temporaries = mem.phase_peak("optimizer") - mem.timeline[-1]
    groups = [sum(p.nbytes for p in g["params"]) for g in opt.param_groups]
    largest = max(p.nbytes for p in model.parameters())
    if foreach:
        assert temporaries == max(groups)
    else:
        assert 2 * largest <= temporaries <= 3 * largest < max(groups)


def test_the_fused_adamw_step_allocates_nothing():
    A = importlib.import_module("kernels.model.adamw")
    n = 3000
    w, g = torch.zeros(n, dtype=torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    with TensorPeak(track=[w, g, p, m, v]) as probe:
        A.fused_adamw_(w, g, p, m, v, step=1, **hp)
    assert probe.peak_bytes == n * 16 and set(probe.timeline) == {n * 16}
