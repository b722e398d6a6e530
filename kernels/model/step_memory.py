"""The memory of one training step of the tiny GPT, measured tensor by tensor, against the byte ledger.

:func:`step_memory` runs one step of the course's recipe (:func:`kernels.model.train.train_step`:
forward and loss, the previous gradients dropped, backward, clipping, the optimizer's update) under
:class:`kernels.tensor_memory.TensorPeak`, with the parameters, the optimizer's state and the previous
step's gradients tracked from the start. It returns the timeline of live bytes with its phases and
what was alive at the peak, sorted into the ledger's entries:

    parameters + optimizer state + gradients (this step's and the previous one's) + the rest

where the rest is the activations autograd saved, the logits and the loss, and the temporaries of
whatever operation was running. The batch (the token ids) is the data loader's and is not counted.
:func:`saved_activation_bytes` counts the activations a second way, with ``saved_tensors_hooks``
(each storage once, parameters and batch left out), so that the rest can be checked against it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from kernels.tensor_memory import TensorPeak
from kernels.model.train import train_step


@dataclass
class StepMemory:
    """One step's live tensor bytes. ``timeline[i]``: after the i-th operation; ``phases``: label ->
    index one past the phase's last operation, in order; ``at_peak``: the peak's bytes by ledger entry."""

    timeline: list[int]
    phases: dict[str, int]
    peak_bytes: int
    peak_index: int
    at_peak: dict[str, int]
    params: int                       # bytes of the parameters
    state: int                        # bytes of the optimizer's state
    previous_grads: int               # bytes of the gradients alive when the step began

    @property
    def peak_phase(self) -> str:
        return next(label for label, end in self.phases.items() if self.peak_index < end)

    def phase_peak(self, label: str) -> int:
        """The largest live total during phase ``label``."""
        labels = list(self.phases)
        start = self.phases[labels[labels.index(label) - 1]] if labels.index(label) else 0
        return max(self.timeline[start:self.phases[label]])


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def step_memory(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
                clip: float = 1.0) -> StepMemory:
    """Measure one :func:`train_step` of ``model`` with ``opt`` on the batch x, y (B, T). The optimizer
    must have taken a step already (its state exists, as in every step but the first)."""
    params = list(model.parameters())
    state = _state_tensors(opt)
    if not state:
        raise ValueError("step_memory: the optimizer has no state yet; take one step first, so that the "
                         "measured step is a typical one (every step but the first)")
    grads = [p.grad for p in params if p.grad is not None]
    previous = [StorageWeakRef(g.untyped_storage()) for g in grads]      # weak: the step frees them
    sizes = {"params": sum(p.untyped_storage().nbytes() for p in params),
             "state": sum(t.untyped_storage().nbytes() for t in state),
             "previous_grads": sum(g.untyped_storage().nbytes() for g in grads)}
    with TensorPeak(track=params + state + grads) as probe:
        del grads
        train_step(model, opt, x, y, clip=clip, mark=probe.mark)
    at_peak = {"parameters": probe.bytes_at_peak(params), "optimizer state": probe.bytes_at_peak(state),
               "gradients (this step)": probe.bytes_at_peak([p.grad for p in params if p.grad is not None]),
               "gradients (previous step)": probe.bytes_at_peak(previous)}
    at_peak["activations, logits, temporaries"] = probe.peak_bytes - sum(at_peak.values())
    return StepMemory(timeline=probe.timeline, phases=dict(probe.marks), peak_bytes=probe.peak_bytes,
                      peak_index=probe.peak_index, at_peak=at_peak, **sizes)


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """The forward and loss of :func:`train_step` on x, y once more, counting with ``saved_tensors_hooks``
    what autograd saves for the backward: each storage once, the parameters' and the batch's left out
    (they are not activations). Returns {"saved": bytes, "logits": bytes of the (B, T, V) logits,
    "loss": bytes of the loss}."""
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), x, y)}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)                                             # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return {"saved": sum(saved.values()), "logits": logits.untyped_storage().nbytes(),
            "loss": loss.untyped_storage().nbytes()}
