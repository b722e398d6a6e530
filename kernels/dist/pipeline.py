"""Pipeline parallelism: schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1) as per-stage op lists, a
simulator that times them, and a real 1F1B run of the tiny GPT over gloo ranks.

The model's layers are cut into p stages, one per rank; a batch is cut into m micro-batches. Each
stage runs, per micro-batch, a forward F (receive the activation from the stage before, send its
output on) and a backward B (receive the gradient from the stage after, send the input gradient
back). Zero-bubble schedules split B into B (the input gradient, on the critical path) and W (the
weight gradients, which nothing downstream waits for). An op is ``Op(kind, mb, chunk)``; with
interleaving a rank holds v model chunks, chunk c of rank s being virtual stage c p + s; in the V
placement of ZB-V (v = 2) chunk 1 of rank s is virtual stage 2p - 1 - s, so the forward goes down the
ranks and back up, and rank 0 holds both the first and the last virtual stage.

Bubble (idle) fraction of the step, T_F, T_B, T_W the op times of a whole stage:

* GPipe and 1F1B: (p - 1)(T_F + T_B) idle per stage, over a step of (m + p - 1)(T_F + T_B):
  fraction (p - 1) / (m + p - 1); 1F1B keeps at most p - s micro-batches in flight on stage s,
  GPipe all m (Huang et al. 2019; Narayanan et al. 2021 for 1F1B as PipeDream-Flush);
* interleaved 1F1B with v chunks per rank: the ramp is made of chunk ops of cost 1/v:
  fraction (p - 1) / (v m + p - 1) (Narayanan et al. 2021, section 2.2.2);
* ZB-H1 (B split into B and W, in flight at most p micro-batches on any stage, 1F1B's peak):
  idle (p - 1)(T_F + T_B - T_W) per stage (Qi et al. 2023, section 2.1), for T_W <= min(T_F, T_B)
  only (:func:`bubble_zb_h1` raises outside it);
* ZB-V (Qi et al. 2024, the V schedule of sail-sg/zero-bubble-pipeline-parallelism): two chunks per
  rank placed in a V (rank s holds virtual stages s and 2p - 1 - s), B split from W, at most 2p chunk
  activations (1F1B's p stages' worth) per rank. With T_F = T_B = T_W and m >= 2p every rank is busy
  from its first op to its last: the only idle time is the (p - 1) chunk forwards the last rank waits
  before it can start, (p - 1) T_F / 2 over a step of m (T_F + T_B + T_W) plus that idle;
* DualPipe and DualPipeV (deepseek-ai/DualPipe README): idle (PP/2 - 1)(F&B + B - 3W) in chunk times,
  B the full backward, F&B a forward and a backward of two micro-batches run overlapped; given here as
  the README's formula (:func:`bubble_dualpipe`), not simulated.

:func:`simulate` executes the per-stage lists in order, each op starting when its stage is free and
its inputs exist, and reports start/end times, the bubble fraction and the peak number of
micro-batches whose activations a stage holds; a list that can never finish raises
:class:`ScheduleDeadlock`. The chapter checks every formula above against it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

KINDS = ("F", "B", "W")


class Op(NamedTuple):
    kind: str        # "F", "B" (with W folded in unless the schedule has W ops) or "W"
    mb: int          # micro-batch
    chunk: int = 0   # model chunk on this rank (interleaving); virtual stage chunk * p + stage


class ScheduleDeadlock(RuntimeError):
    """Every stage waits on an op that another stage will only run later."""


def _check_pm(p: int, m: int, name: str) -> None:
    if not (isinstance(p, int) and p >= 1):
        raise ValueError(f"{name}: p (stages) must be a positive int, got {p!r}")
    if not (isinstance(m, int) and m >= 1):
        raise ValueError(f"{name}: m (micro-batches) must be a positive int, got {m!r}")


# ---------------------------------------------------------------- the schedules

def gpipe(p: int, m: int) -> list[list[Op]]:
    """Every forward, then every backward (Huang et al. 2019)."""
    _check_pm(p, m, "gpipe")
    return [[Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Op]]:
    """1F1B (PipeDream-Flush): stage s runs min(p - s - 1, m) warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards."""
    _check_pm(p, m, "one_f_one_b")
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [Op("F", i) for i in range(warm)]
        for i in range(m - warm):
            order += [Op("F", warm + i), Op("B", i)]
        order += [Op("B", i) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def _interleaved_op(kind: str, k: int, p: int, v: int) -> Op:
    """The k-th forward (or backward) of a rank in Megatron's interleaved order: groups of p
    micro-batches go through chunk 0, 1, ... (forward) or v-1, ..., 0 (backward)."""
    group = (k // p) % v
    chunk = group if kind == "F" else v - 1 - group
    return Op(kind, (k // (p * v)) * p + k % p, chunk)


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Op]]:
    """Interleaved 1F1B (Narayanan et al. 2021): v chunks per rank; warm-up of 2 (p - s - 1) +
    (v - 1) p chunk-forwards, then one forward / one backward. Megatron requires m % p == 0."""
    _check_pm(p, m, "interleaved_1f1b")
    if not (isinstance(v, int) and v >= 1):
        raise ValueError(f"interleaved_1f1b: v (chunks per rank) must be a positive int, got {v!r}")
    if m % p:
        raise ValueError(f"interleaved_1f1b: m={m} micro-batches must be a multiple of p={p} stages")
    total = m * v
    orders = []
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        order = [_interleaved_op("F", k, p, v) for k in range(warm)]
        for i in range(total - warm):
            order += [_interleaved_op("F", warm + i, p, v), _interleaved_op("B", i, p, v)]
        order += [_interleaved_op("B", k, p, v) for k in range(total - warm, total)]
        orders.append(order)
    return orders


def zb_h1(p: int, m: int) -> list[list[Op]]:
    """ZB-H1 (Qi et al. 2023): 1F1B's order with every backward split into B and W, and stage s
    running each W s micro-batches late. The first stage keeps 1F1B's p micro-batches in flight;
    every other stage now holds p too (its later Ws keep activations longer), and the postponed
    Ws fill the time the next B would otherwise be waited for. Needs m >= p."""
    _check_pm(p, m, "zb_h1")
    if m < p:
        raise ValueError(f"zb_h1: needs at least as many micro-batches as stages, got m={m} < p={p}")
    orders = []
    for s in range(p):
        warm = p - s - 1
        order, late = [Op("F", i) for i in range(warm)], []
        for i in range(m):
            if warm + i < m:
                order.append(Op("F", warm + i))
            order.append(Op("B", i))
            late.append(i)
            if len(late) > s:                          # W of micro-batch i - s
                order.append(Op("W", late.pop(0)))
        orders.append(order + [Op("W", i) for i in late])
    return orders


def virtual_stage(s: int, chunk: int, p: int, placement: str = "interleaved") -> int:
    """The virtual stage that chunk ``chunk`` of rank ``s`` runs: c p + s (interleaved, Megatron) or,
    in ZB-V's V placement (two chunks), s for chunk 0 and 2p - 1 - s for chunk 1."""
    if placement == "interleaved":
        return chunk * p + s
    if placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"virtual_stage: the V placement has chunks 0 and 1, got chunk={chunk}")
        return s if chunk == 0 else 2 * p - 1 - s
    raise ValueError(f"virtual_stage: placement must be 'interleaved' or 'v', got {placement!r}")


def _rank_of(vs: int, p: int, placement: str) -> int:
    return vs % p if placement == "interleaved" else (vs if vs < p else 2 * p - 1 - vs)


# ZB-V's priority among the ops a free rank could start (W only when none of these is ready): finish
# a micro-batch (B of chunk 0), push an older one down the V (F of chunk 1), then B of chunk 1, then
# admit a new micro-batch (F of chunk 0) while the rank holds fewer than 2p chunk activations
_ZB_V_PRIORITY = (("B", 0), ("F", 1), ("B", 1), ("F", 0))


def zb_v(p: int, m: int) -> list[list[Op]]:
    """ZB-V (Qi et al. 2024): two chunks per rank in the V placement, B split from W, each rank holding
    at most 2p chunk activations (1F1B's peak of p whole stages). The order is built by list
    scheduling at equal chunk times T_F = T_B = T_W: at each time step a free rank starts the first
    ready op in ``_ZB_V_PRIORITY``, else its oldest pending W, else waits. For m >= 2p this reaches
    the lower bound on the step, (p - 1) chunk forwards (the last rank's wait for its first input)
    plus the 6m chunk ops every rank must run: no rank idles once it has started. The orders are
    returned for :func:`simulate` (placement="v", v=2) to time under any op times."""
    _check_pm(p, m, "zb_v")
    ends: dict = {}                                   # (kind, virtual stage, mb) -> end time step
    nxt = [{key: 0 for key in _ZB_V_PRIORITY} for _ in range(p)]
    pending_w = [[] for _ in range(p)]
    held = [0] * p
    orders = [[] for _ in range(p)]
    step, left = 0, 6 * m * p

    def deps(kind: str, vs: int, mb: int) -> list:
        if kind == "F":
            return [("F", vs - 1, mb)] if vs > 0 else []
        return [("F", vs, mb)] + ([("B", vs + 1, mb)] if vs < 2 * p - 1 else [])

    while left:
        started = []
        for s in range(p):
            op = None
            for kind, chunk in _ZB_V_PRIORITY:
                mb = nxt[s][(kind, chunk)]
                if mb >= m or (kind == "F" and held[s] >= 2 * p):
                    continue
                vs = virtual_stage(s, chunk, p, "v")
                if all(ends.get(d, step + 1) <= step for d in deps(kind, vs, mb)):
                    op = Op(kind, mb, chunk)
                    break
            if op is None and pending_w[s]:
                op = pending_w[s].pop(0)
            if op is not None:
                started.append((s, op))
        for s, op in started:                         # all chosen at this step, then committed
            ends[(op.kind, virtual_stage(s, op.chunk, p, "v"), op.mb)] = step + 1
            orders[s].append(op)
            if op.kind == "W":
                held[s] -= 1
            else:
                nxt[s][(op.kind, op.chunk)] += 1
                held[s] += op.kind == "F"
                if op.kind == "B":
                    pending_w[s].append(Op("W", op.mb, op.chunk))
        left -= len(started)
        step += 1
    return orders


# ---------------------------------------------------------------- the simulator

@dataclass
class Timeline:
    """What :func:`simulate` found: ``spans[s]`` is stage s's list of (op, start, end)."""
    spans: list
    makespan: float
    busy: list
    peak_inflight: list

    @property
    def bubble_fraction(self) -> float:
        """Idle share of p * makespan."""
        p = len(self.busy)
        return 1.0 - sum(self.busy) / (p * self.makespan)


def simulate(orders: list[list[Op]], t_f: float = 1.0, t_b: float = 2.0, t_w: float = 0.0,
             v: int = 1, comm: float = 0.0, placement: str = "interleaved") -> Timeline:
    """Run each stage's list in order. Op costs are for a whole stage (one chunk costs 1/v of it);
    ``t_b`` is the backward without W when the lists contain W ops, with it otherwise.
    Dependencies: F(vs, i) after F(vs - 1, i); B(vs, i) after F(vs, i) and B(vs + 1, i); W after B;
    ``comm`` seconds are added to a dependency that crosses ranks. Activations of micro-batch i are
    held on a rank from the start of its F until the end of its W (or of its B if there is no W).
    ``placement`` maps (rank, chunk) to a virtual stage (:func:`virtual_stage`; "v" needs v = 2)."""
    p = len(orders)
    if p < 1:
        raise ValueError("simulate: orders must hold one list per stage")
    if placement == "v" and v != 2:
        raise ValueError(f"simulate: the V placement has two chunks per rank, got v={v}")
    has_w = any(op.kind == "W" for order in orders for op in order)
    cost = {"F": t_f / v, "B": t_b / v, "W": t_w / v}
    end: dict = {}
    spans = [[] for _ in range(p)]
    ptr, free = [0] * p, [0.0] * p
    n_vs = p * v

    def ready(s: int, op: Op):
        vs = virtual_stage(s, op.chunk, p, placement)
        deps = []
        if op.kind == "F" and vs > 0:
            deps.append(("F", vs - 1, op.mb))
        if op.kind == "B":
            deps.append(("F", vs, op.mb))
            if vs < n_vs - 1:
                deps.append(("B", vs + 1, op.mb))
        if op.kind == "W":
            deps.append(("B", vs, op.mb))
        t = 0.0
        for d in deps:
            if d not in end:
                return None
            cross = _rank_of(d[1], p, placement) != s
            t = max(t, end[d] + (comm if cross else 0.0))
        return t

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                op = orders[s][ptr[s]]
                if op.kind not in KINDS:
                    raise ValueError(f"simulate: unknown op kind {op.kind!r}")
                t = ready(s, op)
                if t is None:
                    break
                start = max(free[s], t)
                free[s] = start + cost[op.kind]
                end[(op.kind, virtual_stage(s, op.chunk, p, placement), op.mb)] = free[s]
                spans[s].append((op, start, free[s]))
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {s: orders[s][ptr[s]] for s in range(p) if ptr[s] < len(orders[s])}
            raise ScheduleDeadlock(f"simulate: no stage can run its next op: {waiting}")
    peaks = []
    for s in range(p):
        events = []
        for op, start, stop in spans[s]:
            if op.kind == "F":
                events.append((start, 1))
            elif op.kind == ("W" if has_w else "B"):
                events.append((stop, -1))
        level = peak = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):   # frees before allocations at a tie
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    makespan = max(free)
    busy = [sum(b - a for _, a, b in spans[s]) for s in range(p)]
    return Timeline(spans, makespan, busy, peaks)


# ---------------------------------------------------------------- the derived bubbles

def bubble_1f1b(p: int, m: int) -> float:
    """(p - 1) / (m + p - 1), GPipe and 1F1B alike."""
    return (p - 1) / (m + p - 1)


def bubble_interleaved(p: int, m: int, v: int) -> float:
    """(p - 1) / (v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def bubble_zb_h1(p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """(p - 1)(T_F + T_B - T_W) idle per stage over a step of m (T_F + T_B + T_W) plus that idle.

    Exact only for T_W <= min(T_F, T_B) (Qi et al. 2023, section 2.1): a postponed W then fits in the
    gap it fills. With a longer W the gaps no longer absorb it (the formula undershoots the simulated
    bubble, and for T_W > T_F + T_B turns negative), so such op times raise."""
    _check_pm(p, m, "bubble_zb_h1")
    if not (t_f > 0 and t_b > 0 and t_w >= 0):
        raise ValueError(f"bubble_zb_h1: need t_f > 0, t_b > 0, t_w >= 0, got t_f={t_f}, t_b={t_b}, t_w={t_w}")
    if t_w > min(t_f, t_b):
        raise ValueError(f"bubble_zb_h1: the formula holds for t_w <= min(t_f, t_b) only, got t_f={t_f}, "
                         f"t_b={t_b}, t_w={t_w}; simulate(zb_h1(p, m), t_f, t_b, t_w) gives the bubble outside it")
    idle = (p - 1) * (t_f + t_b - t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)



def bubble_zb_v(p: int, m: int, t: float = 1.0) -> float:
    """ZB-V at T_F = T_B = T_W = t (whole-stage times) and m >= 2p: idle (p - 1) t / 2 per rank (the
    chunk forwards before the last rank's first input) over a step of 3 m t plus that idle. The paper
    (Qi et al. 2024) calls this zero bubble: once a rank starts it never waits, and the ramp-up overlaps
    the previous step's tail when the optimizer's global checks are moved after the update."""
    _check_pm(p, m, "bubble_zb_v")
    if m < 2 * p:
        raise ValueError(f"bubble_zb_v: the count holds for m >= 2p micro-batches, got m={m}, p={p}")
    if not t > 0:
        raise ValueError(f"bubble_zb_v: t (the common op time) must be positive, got {t!r}")
    idle = (p - 1) * t / 2
    return idle / (3 * m * t + idle)


def bubble_dualpipe(pp_stages: int, t_f: float, t_b: float, t_w: float, t_fb: float | None = None) -> float:
    """Idle time per device of DualPipe and DualPipeV as deepseek-ai/DualPipe's README tabulates it:
    (PP/2 - 1)(F&B + B - 3W), with PP the number of pipeline stages (even), F, B (the full backward,
    input and weight gradients) and W the times of one chunk, and F&B the time of a forward and a
    backward of two micro-batches run overlapped (``t_fb``; without overlap F + B, the default).
    DualPipe spreads the PP stages over PP devices with two copies of the parameters, DualPipeV over
    PP/2 devices. Absolute time, not a fraction: the README's table, not a simulation."""
    if not (isinstance(pp_stages, int) and pp_stages >= 2 and pp_stages % 2 == 0):
        raise ValueError(f"bubble_dualpipe: pp_stages must be an even int >= 2, got {pp_stages!r}")
    if not (t_f > 0 and t_b > 0 and 0 <= t_w <= t_b):
        raise ValueError(f"bubble_dualpipe: need t_f > 0, t_b > 0, 0 <= t_w <= t_b, got {t_f}, {t_b}, {t_w}")
    fb = t_f + t_b if t_fb is None else t_fb
    if not max(t_f, t_b) <= fb <= t_f + t_b:
        raise ValueError(f"bubble_dualpipe: t_fb must lie between max(t_f, t_b) and t_f + t_b, got {t_fb}")
    return (pp_stages // 2 - 1) * (fb + t_b - 3 * t_w)


# ---------------------------------------------------------------- a real pipeline: the tiny GPT over p ranks

@dataclass
class StageStats:
    """What one rank did in one step: messages and bytes it sent, the most micro-batches whose
    activations it held at once, and its ops in the order they ran."""
    bytes_sent: int = 0
    messages: int = 0
    peak_inflight: int = 0
    ops: list = field(default_factory=list)


class Stage(torch.nn.Module):
    """Stage s of p of a tiny GPT: the embedding (stage 0), its blocks, the final norm and the tied
    LM head (stage p - 1, with its own copy of the embedding matrix)."""

    def __init__(self, model, s: int, p: int):
        super().__init__()
        n = model.config.n_layer
        if n % p:
            raise ValueError(f"Stage: {n} layers do not split evenly over p={p} stages")
        per = n // p
        self.s, self.p, self.first_block = s, p, s * per
        self.blocks = torch.nn.ModuleList(model.blocks[s * per: (s + 1) * per])
        self.wte = model.wte if s in (0, p - 1) else None      # stage 0 embeds, stage p - 1 projects
        self.norm_f = model.norm_f if s == p - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (stage 0) or the previous stage's activation (B, T, C) -> activation or logits."""
        if self.s == 0:
            x = self.wte(x)
        positions = torch.arange(x.shape[1])
        for block in self.blocks:
            x = block(x, positions)
        if self.s == self.p - 1:
            x = self.norm_f(x) @ self.wte.weight.T                 # (B, T, V)
        return x

    def global_names(self) -> dict[str, str]:
        """This stage's parameter names -> the single-process GPT's names."""
        out = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                i, rest = name.split(".", 2)[1:]
                out[name] = f"blocks.{self.first_block + int(i)}.{rest}"
            else:
                out[name] = name
        return out


def run_schedule(stage: Stage, order: list[Op], idx_mbs, target_mbs, act_shape, *, embed_group=None,
                 stats: StageStats | None = None, broken: str | None = None) -> float | None:
    """One training step's forward and backward on this rank, ops in ``order`` (F and B only).

    Activations go forward and gradients back by ``isend``/``recv`` (a send never blocks, so no
    order of ops that the schedule allows can deadlock on it). The last stage's loss of a
    micro-batch is its token-mean cross-entropy / m, so the m backward passes add up to the
    full-batch mean's gradient. Afterwards the first and last stages all-reduce the gradient of
    their two copies of the tied embedding (``embed_group``); ``broken="no_tied_sync"`` skips it.
    Returns the summed loss on the last stage, None elsewhere."""
    if broken not in (None, "no_tied_sync"):
        raise ValueError(f"run_schedule: broken must be None or 'no_tied_sync', got {broken!r}")
    s, p, m = stage.s, stage.p, len(idx_mbs)
    stats = stats if stats is not None else StageStats()
    held: dict[int, tuple] = {}                       # micro-batch -> (input, output) of its forward
    pending, total = [], None
    dtype = next(stage.parameters()).dtype
    for op in order:
        if op.kind == "F":
            if s == 0:
                inp = idx_mbs[op.mb]
            else:
                inp = torch.empty(act_shape, dtype=dtype)
                dist.recv(inp, s - 1)
                inp.requires_grad_(True)
            out = stage(inp)
            if s == p - 1:
                out = F.cross_entropy(out.flatten(0, 1), target_mbs[op.mb].flatten()) / m
                total = out.detach() if total is None else total + out.detach()
            else:
                pending.append(dist.isend(out.detach().contiguous(), s + 1))
                stats.bytes_sent += out.numel() * out.element_size()
                stats.messages += 1
            held[op.mb] = (inp, out)
            stats.peak_inflight = max(stats.peak_inflight, len(held))
        elif op.kind == "B":
            inp, out = held.pop(op.mb)
            if s == p - 1:
                out.backward()
            else:
                grad = torch.empty(act_shape, dtype=dtype)
                dist.recv(grad, s + 1)
                out.backward(grad)
            if s > 0:
                pending.append(dist.isend(inp.grad.contiguous(), s - 1))
                stats.bytes_sent += inp.grad.numel() * inp.grad.element_size()
                stats.messages += 1
        else:
            raise ValueError(f"run_schedule: the real run takes F and B ops, got {op}")
        stats.ops.append(op)
    for req in pending:
        req.wait()
    if held:
        raise RuntimeError(f"run_schedule: micro-batches {sorted(held)} had no backward in the order")
    if embed_group is not None and stage.wte is not None and p > 1 and broken != "no_tied_sync":
        dist.all_reduce(stage.wte.weight.grad, group=embed_group)   # embedding + LM head gradients
    return None if total is None else float(total)


def micro_batches(idx: torch.Tensor, targets: torch.Tensor, m: int):
    """(idx chunks, target chunks): m equal micro-batches of the batch dimension."""
    if idx.shape[0] % m:
        raise ValueError(f"micro_batches: batch {idx.shape[0]} does not split into m={m} equal micro-batches")
    return list(idx.chunk(m)), list(targets.chunk(m))


def training_data(batch: int, seq: int, steps: int, seed: int = 0):
    """``steps`` (idx, targets) batches of Shakespeare, the same on every rank and in the reference."""
    from kernels.model import data

    tokens = data.encode(data.load_text()[:20000])
    g = torch.Generator().manual_seed(seed)
    return [data.get_batch(tokens, batch, seq, g) for _ in range(steps)]


def _model():
    """The committed tiny GPT in float64, in training mode."""
    from kernels.model.gpt import load_pretrained
    return load_pretrained().double().train()


def reference_training(batch: int, seq: int, steps: int, lr: float = 1e-3) -> dict:
    """The single-process run the pipeline must equal: full-batch AdamW steps on the trained tiny
    GPT in float64. Returns the loss of every step, the first step's gradients and the final weights."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], None
    for idx, targets in training_data(batch, seq, steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        loss.backward()
        if grads is None:
            grads = {n: q.grad.clone() for n, q in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: q.detach().clone() for n, q in model.named_parameters()}}


def pipeline_worker(rank: int, p: int, batch: int, seq: int, m: int, steps: int, lr: float = 1e-3) -> dict:
    """The chapter's launch: ``steps`` AdamW steps of 1F1B over p ranks (one block each), then one
    GPipe step and one 1F1B step without the tied-embedding all-reduce, each from the same start.
    Returns per schedule: losses (last stage), first-step gradients and final weights in the
    single-process names, and the step's StageStats."""
    dist.barrier()
    embed_group = dist.new_group([0, p - 1])          # every rank takes part in creating a group
    data = training_data(batch, seq, steps)
    out = {}
    for label, schedule, n_steps, broken in (("1f1b", one_f_one_b, steps, None), ("gpipe", gpipe, 1, None),
                                             ("no_tied_sync", one_f_one_b, 1, "no_tied_sync")):
        stage = Stage(_model(), rank, p)
        opt = torch.optim.AdamW(stage.parameters(), lr=lr)
        order = schedule(p, m)[rank]
        losses, grads, stats = [], None, None
        for idx, targets in data[:n_steps]:
            opt.zero_grad()
            idx_mbs, tgt_mbs = micro_batches(idx, targets, m)
            act_shape = (batch // m, seq, stage.blocks[0].config.d_model)
            stats = StageStats()
            loss = run_schedule(stage, order, idx_mbs, tgt_mbs, act_shape, embed_group=embed_group,
                                stats=stats, broken=broken)
            names = stage.global_names()
            if grads is None:
                grads = {names[n]: q.grad.clone() for n, q in stage.named_parameters()}
            opt.step()
            losses.append(loss)
        out[label] = {"losses": losses, "grads": grads, "stats": stats,
                      "params": {names[n]: q.detach().clone() for n, q in stage.named_parameters()}}
    return out


def max_rel_diff(got: dict, want: dict) -> float:
    """max over names of max|got - want| / max|want| (names of ``got`` only)."""
    worst = 0.0
    for n, g in got.items():
        scale = float(want[n].abs().max()) or 1.0
        worst = max(worst, float((g - want[n]).abs().max()) / scale)
    return worst

