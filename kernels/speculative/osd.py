"""Online speculative decoding: the draft model distilled on the server's own traffic.

Speculative decoding is only as fast as its draft's acceptance rate, alpha = sum_x min(p(x), q(x))
= 1 - TV(p, q) per position (:func:`kernels.speculative.sampling.acceptance_rate`), and a draft
prepared on one distribution meets another in service. Online speculative decoding (Liu et al.
2024) keeps the draft learning: the server already computes the target's distribution p at every
position it verifies, so it buffers (tokens, p) from the requests it serves and, every so often,
distills the draft q on the buffer, minimising a divergence D(p, q) by gradient descent.

Here: the target is the tiny GPT fine-tuned on the addition task (``kernels.rl.sft``), the draft a
1-block truncated copy of the *Shakespeare* tiny GPT (``kernels.speculative.drafts.truncated_copy``),
the traffic the task's addition prompts (``kernels.rl.task``): bytes \\x01, \\x02, \\x03 and the
"aa+bb" format never occur in Shakespeare, so the draft starts with no idea of what the target says.

The divergence is the forward KL of the target's p from the draft's q, per position (row):

    KL(p || q) = sum_v p_v (log p_v - log q_v),   p = softmax(t), q = softmax(z)      (t, z: logits)
    d KL / d z_v = q_v - p_v                                       (the gradient to the draft's logits)

:func:`forward_kl_ref` is the PyTorch reference; :func:`forward_kl` the Triton kernel that returns the
row losses and the gradient in one launch, two passes over the vocabulary in tiles (pass 1: running
max and sum of exponentials of t and z; pass 2: the loss terms and q - p). ``broken="no_max"`` skips
the max-subtraction (exp overflows at logits of ~89 in fp32), ``broken="reverse"`` sums KL(q || p)
instead: both are deliberately wrong, kept for the tests to catch.

The online loop (:func:`online_run`, the committed run ``python -m kernels.speculative.osd``): serve
a round of requests through the course's engine (``kernels.serving.engine.Engine`` with
``EngineConfig(speculative=DraftModel(draft))`` and ``record_logits=True``), buffer the target's
logits at every emitted token, distill the draft on the buffer, clear it, and measure the draft on
held-out prompts after every update: the engine's greedy acceptance (exact counts), tokens per
target forward, and the sampled-decoding alpha (the mean of sum min(p, q)).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.model.gpt import GPT
from kernels.serving.sampling import GPU_BLOCK_V, default_block_v

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "models" / "osd"
BROKEN = (None, "no_max", "reverse")
LLAMA3_VOCAB = 128256


# ---------------------------------------------------------------- the divergence, PyTorch

def forward_kl_ref(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, p = softmax(target_logits), q = softmax(draft_logits): (N, V), (N, V) -> (N,) fp32.
    Differentiable in the draft's logits (autograd gives q - p per row)."""
    logp = torch.log_softmax(target_logits.float(), -1)                  # (N, V)
    logq = torch.log_softmax(draft_logits.float(), -1)                   # (N, V)
    return (logp.exp() * (logp - logq)).sum(-1)                          # sum_v p_v (log p_v - log q_v)


# ---------------------------------------------------------------- the divergence, Triton

@triton.jit
def _forward_kl_kernel(t_ptr, z_ptr, loss_ptr, grad_ptr, stride_t, stride_z, stride_g, V,
                       BLOCK_V: tl.constexpr, BROKEN: tl.constexpr):
    """One program per row: pass 1, running max and sum of exp of t and z over vocabulary tiles;
    pass 2, loss = sum p (log p - log q) and grad = q - p. BROKEN 1: no max-subtraction; 2: KL(q || p)."""
    row = tl.program_id(0).to(tl.int64)                   # row * stride passes 2**31 at N * 128256 logits
    t_row = t_ptr + row * stride_t
    z_row = z_ptr + row * stride_z
    g_row = grad_ptr + row * stride_g
    mt = tl.full((), float("-inf"), tl.float32)
    mz = tl.full((), float("-inf"), tl.float32)
    st = tl.zeros((), tl.float32)
    sz = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):                    # pass 1: log-sum-exp of both rows, online
        i = start + tl.arange(0, BLOCK_V)
        ok = i < V
        t = tl.load(t_row + i, mask=ok, other=float("-inf")).to(tl.float32)
        z = tl.load(z_row + i, mask=ok, other=float("-inf")).to(tl.float32)
        if BROKEN == 1:                                   # broken: exp of the raw logits
            st += tl.sum(tl.exp(t), axis=0)
            sz += tl.sum(tl.exp(z), axis=0)
            mt = 0.0
            mz = 0.0
        else:
            mt_new = tl.maximum(mt, tl.max(t, axis=0))
            mz_new = tl.maximum(mz, tl.max(z, axis=0))
            st = st * tl.exp(mt - mt_new) + tl.sum(tl.exp(t - mt_new), axis=0)
            sz = sz * tl.exp(mz - mz_new) + tl.sum(tl.exp(z - mz_new), axis=0)
            mt = mt_new
            mz = mz_new
    lt = mt + tl.log(st)                                  # log sum_v exp t_v
    lz = mz + tl.log(sz)
    acc = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):                    # pass 2: the loss terms and the gradient
        i = start + tl.arange(0, BLOCK_V)
        ok = i < V
        t = tl.load(t_row + i, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_row + i, mask=ok, other=0.0).to(tl.float32)
        logp = t - lt
        logq = z - lz
        p = tl.exp(logp)
        q = tl.exp(logq)
        if BROKEN == 2:                                   # broken: the KL the other way round
            term = q * (logq - logp)
        else:
            term = p * (logp - logq)
        acc += tl.where(ok, term, 0.0)
        tl.store(g_row + i, q - p, mask=ok)               # d KL(p || q) / d z
    tl.store(loss_ptr + row, tl.sum(acc, axis=0))


def check_kl_inputs(target_logits, draft_logits, name: str = "forward_kl") -> None:
    for arg, x in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name}: {arg} must be a 2-D (N, V) tensor, got {getattr(x, 'shape', type(x))}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name}: {arg} must be float32, float16 or bfloat16, got {x.dtype}")
        if x.shape[1] and x.stride(1) != 1:
            raise ValueError(f"{name}: {arg} must be contiguous along V (stride 1), got strides {x.stride()}")
    if target_logits.shape != draft_logits.shape:
        raise ValueError(f"{name}: target_logits {tuple(target_logits.shape)} and draft_logits "
                         f"{tuple(draft_logits.shape)} must have the same shape")
    if target_logits.device != draft_logits.device:
        raise ValueError(f"{name}: target_logits and draft_logits must be on one device, got "
                         f"{target_logits.device} and {draft_logits.device}")
    if target_logits.shape[1] < 1:
        raise ValueError(f"{name}: the vocabulary must hold at least one token")


def _kl_args(t, z, loss, grad, *, block_v: int, broken: str | None = None, num_warps: int = 4):
    """(grid, args, kwargs) of one launch of :func:`_forward_kl_kernel` (shared with :func:`launch_job`)."""
    N, V = t.shape
    args = (t, z, loss, grad, t.stride(0), z.stride(0), grad.stride(0), V)
    return (N,), args, dict(BLOCK_V=block_v, BROKEN=BROKEN.index(broken), num_warps=num_warps)


def forward_kl(target_logits: torch.Tensor, draft_logits: torch.Tensor, *, block_v: int | None = None,
               broken: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton forward KL: (N, V), (N, V) -> (loss (N,) fp32, grad (N, V) fp32 = q - p)."""
    check_kl_inputs(target_logits, draft_logits)
    if broken not in BROKEN:
        raise ValueError(f"forward_kl: broken must be one of {BROKEN}, got {broken!r}")
    if block_v is not None and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"forward_kl: block_v must be a power of two >= 16, got {block_v}")
    N, V = target_logits.shape
    loss = torch.empty(N, dtype=torch.float32, device=target_logits.device)
    grad = torch.empty(N, V, dtype=torch.float32, device=target_logits.device)
    if N == 0:
        return loss, grad
    grid, args, kwargs = _kl_args(target_logits, draft_logits, loss, grad,
                                  block_v=block_v or default_block_v(V), broken=broken)
    _forward_kl_kernel[grid](*args, **kwargs)
    return loss, grad


class _ForwardKL(torch.autograd.Function):
    """The kernel as a differentiable loss: the gradient is computed in the forward pass and scaled."""

    @staticmethod
    def forward(ctx, target_logits, draft_logits):
        loss, grad = forward_kl(target_logits.detach(), draft_logits.detach())
        ctx.save_for_backward(grad)
        ctx.dtype = draft_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return None, (grad * g[:, None]).to(ctx.dtype)


def distill_loss(target_logits, draft_logits, *, use_kernels: bool = False) -> torch.Tensor:
    """Mean forward KL over the rows: the reference under autograd, or the Triton kernel."""
    if use_kernels:
        return _ForwardKL.apply(target_logits, draft_logits).mean()
    return forward_kl_ref(target_logits.detach(), draft_logits).mean()


def launch_job(rows: int, vocab: int = LLAMA3_VOCAB, *, dtype=torch.bfloat16, target: str = "sm90"):
    """The GPU launch of :func:`forward_kl` on meta tensors."""
    from kernels import inspect as ki

    t = torch.empty(rows, vocab, dtype=dtype, device="meta")
    z = torch.empty(rows, vocab, dtype=dtype, device="meta")
    loss = torch.empty(rows, device="meta")
    grad = torch.empty(rows, vocab, device="meta")
    grid, args, kwargs = _kl_args(t, z, loss, grad, block_v=GPU_BLOCK_V)
    return ki.launch_job(_forward_kl_kernel, *args, target=target, grid=grid, **kwargs)


def compile_jobs() -> dict:
    """Llama 3's vocabulary (128256): 32768 buffered positions in bf16 (4.2e9 logits: row offsets past
    2**31), 8192 in fp32."""
    return {f"V 128256, {n} rows, {str(dt).split('.')[-1]}": launch_job(n, dtype=dt)
            for n, dt in ((32768, torch.bfloat16), (8192, torch.float32))}


# ---------------------------------------------------------------- serving and the online loop

def serve(target: GPT, prompts: list[list[int]], *, draft: GPT | None = None, max_tokens: int = 6,
          num_draft: int = 4, record: bool = False) -> dict:
    """Serve greedy requests (stopping at the task's end-of-turn byte) through the course's engine,
    speculatively with ``draft`` or plainly without. Returns the answers, the target forwards that
    produced tokens (prefill and verification runs, summed over requests), the drafted/accepted
    counts, the wall seconds, and with ``record`` the buffer: (prompt + answer, target logits (n, V)
    at the n positions that emitted the answer's tokens) per request."""
    from kernels.rl.task import END
    from kernels.serving.engine import Engine, EngineConfig
    from kernels.serving.sampling import SamplingParams
    from kernels.speculative.serving import DraftModel

    config = EngineConfig(speculative=DraftModel(draft) if draft is not None else None, num_draft=num_draft,
                          max_seqs=64)
    engine = Engine(target, config, record_logits=record)
    t0 = time.perf_counter()
    seqs = [engine.add(p, params=SamplingParams(max_tokens=max_tokens, stop_token_ids=(END,))) for p in prompts]
    engine.run()
    seconds = time.perf_counter() - t0
    forwards = sum(1 for step in engine.history for (_, _, _, sampled) in step if sampled)
    st = engine.spec_stats
    out = dict(answers=[list(s.generated) for s in seqs], forwards=forwards, drafted=st.drafted,
               accepted=st.accepted, tokens=sum(len(s.generated) for s in seqs), seconds=seconds)
    if record:
        out["buffer"] = [(list(s.tokens), torch.stack(engine.logits[s.id]).float()) for s in seqs]
    return out


def pack(buffer: list, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The buffer as a batch: ids (B, L) zero-padded, target logits (B, A, V) and a mask (B, A) of the
    answer positions; position prompt_len - 1 + j of ids predicts answer token j."""
    A = max(len(lg) for _, lg in buffer)
    V = buffer[0][1].shape[1]
    ids = torch.zeros(len(buffer), prompt_len + A - 1, dtype=torch.long)
    tl_ = torch.zeros(len(buffer), A, V)
    mask = torch.zeros(len(buffer), A, dtype=torch.bool)
    for b, (tokens, lg) in enumerate(buffer):
        n = len(lg)
        ids[b, : prompt_len + n - 1] = torch.tensor(tokens[: prompt_len + n - 1])
        tl_[b, :n], mask[b, :n] = lg, True
    return ids, tl_, mask


def draft_logits_at(draft: GPT, ids: torch.Tensor, prompt_len: int, A: int) -> torch.Tensor:
    """The draft's logits (B, A, V) at the answer positions prompt_len - 1 .. prompt_len + A - 2."""
    return draft(ids)[:, prompt_len - 1: prompt_len - 1 + A]


def distill(draft: GPT, buffer: list, prompt_len: int, *, steps: int, lr: float, opt=None,
            use_kernels: bool = False) -> list[float]:
    """``steps`` Adam steps of the mean forward KL(p || q) over the buffer's answer positions."""
    ids, t_logits, mask = pack(buffer, prompt_len)
    opt = opt or torch.optim.Adam(draft.parameters(), lr=lr)
    draft.train()
    losses = []
    for _ in range(steps):
        z = draft_logits_at(draft, ids, prompt_len, t_logits.shape[1])              # (B, A, V)
        loss = distill_loss(t_logits[mask], z[mask], use_kernels=use_kernels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    draft.eval()
    return losses


@torch.no_grad()
def sampled_alpha(draft: GPT, buffer: list, prompt_len: int) -> tuple[float, float]:
    """On a buffer of the target's answers: (mean alpha = sum min(p, q) at temperature 1, mean KL(p || q))
    over the answer positions."""
    from kernels.speculative.sampling import acceptance_rate

    ids, t_logits, mask = pack(buffer, prompt_len)
    z = draft_logits_at(draft, ids, prompt_len, t_logits.shape[1])[mask]
    p, q = torch.softmax(t_logits[mask], -1), torch.softmax(z.float(), -1)
    return float(acceptance_rate(p, q).mean()), float(forward_kl_ref(t_logits[mask], z).mean())


def evaluate(target: GPT, draft: GPT, prompts: list[list[int]], reference: dict) -> dict:
    """The draft on held-out prompts: the engine's greedy counts (answers asserted equal to plain
    decoding's) and the sampled alpha / KL on the target's recorded answers."""
    from kernels.rl.task import PROMPT_LEN

    r = serve(target, prompts, draft=draft)
    if r["answers"] != reference["answers"]:
        raise AssertionError("speculative answers differ from plain greedy decoding")
    alpha, kl = sampled_alpha(draft, reference["buffer"], PROMPT_LEN)
    return dict(drafted=r["drafted"], accepted=r["accepted"], forwards=r["forwards"], tokens=r["tokens"],
                seconds=r["seconds"], alpha=alpha, kl=kl)


def online_run(*, rounds: int = 8, per_round: int = 64, held_out: int = 64, steps: int = 60, lr: float = 3e-3,
               seed: int = 0, progress: bool = True) -> dict:
    """The online loop against the offline alternative; returns the log (JSON-able)."""
    from tqdm import tqdm

    from kernels.model.gpt import load_pretrained
    from kernels.rl import task
    from kernels.rl.sft import load_sft
    from kernels.speculative.drafts import truncated_copy

    torch.manual_seed(seed)
    target = load_sft()
    base_draft = truncated_copy(load_pretrained(), 1)
    train_pairs, held_pairs = task.split_pairs()
    order = torch.randperm(len(train_pairs), generator=torch.Generator().manual_seed(seed))
    traffic = task.prompts(train_pairs[order[: rounds * per_round]]).tolist()
    held = task.prompts(held_pairs[:held_out]).tolist()
    plain = serve(target, held, record=True)                      # the held-out workload, plainly decoded

    online = truncated_copy(load_pretrained(), 1)
    opt = torch.optim.Adam(online.parameters(), lr=lr)
    curve = [dict(requests=0, **evaluate(target, online, held, plain))]
    served = []
    for r in tqdm(range(rounds), desc="online distillation rounds", disable=not progress):
        batch = serve(target, traffic[r * per_round: (r + 1) * per_round], draft=online, record=True)
        served.append(dict(drafted=batch["drafted"], accepted=batch["accepted"], forwards=batch["forwards"],
                           tokens=batch["tokens"]))
        losses = distill(online, batch["buffer"], task.PROMPT_LEN, steps=steps, lr=lr, opt=opt)
        curve.append(dict(requests=(r + 1) * per_round, train_loss_first=losses[0], train_loss_last=losses[-1],
                          **evaluate(target, online, held, plain)))

    # offline: the draft distilled once, before deployment, on a fixed sample of one round's size,
    # with the same total number of optimizer steps as the online draft took
    offline = truncated_copy(load_pretrained(), 1)
    sample = serve(target, traffic[:per_round], record=True)
    distill(offline, sample["buffer"], task.PROMPT_LEN, steps=steps * rounds, lr=lr)
    del base_draft
    return dict(config=dict(rounds=rounds, per_round=per_round, held_out=held_out, steps=steps, lr=lr, seed=seed,
                            num_draft=4, max_tokens=6),
                plain=dict(forwards=plain["forwards"], tokens=plain["tokens"], seconds=plain["seconds"]),
                curve=curve, served=served, offline=evaluate(target, offline, held, plain))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.speculative.osd", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--per-round", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    log = online_run(rounds=args.rounds, per_round=args.per_round, steps=args.steps)
    log["wall_seconds"] = time.time() - t0
    log["command"] = "python -m kernels.speculative.osd" + (" " + " ".join(argv) if argv else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({k: log[k] for k in ("plain", "offline")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
