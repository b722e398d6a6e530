"""Pipeline parallelism: every schedule's simulated bubble against its formula (exactly), in-flight
bounds, a deadlocking order caught, bubble_zb_h1's range enforced; then 1F1B and GPipe of the tiny GPT
over 2 gloo ranks (one launch for the module, kernels.dist.pipeline.pipeline_worker) against
single-process AdamW training, the bytes and in-flight counts of the derivation, and the missing
tied-embedding all-reduce caught."""
import pytest

from kernels.dist import pipeline as pp
from kernels.dist.launch import launch

P, B, T, M, STEPS = 2, 4, 8, 4, 2
C, E = 128, 8                      # tiny GPT width, float64
# float64 model whose RMSNorm computes in float32: the bound of the chapter and the TP/CP tests
REL = 1e-6


# ---------------------------------------------------------------- the simulator and the formulas

@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_gpipe_and_1f1b_bubble_and_in_flight(p, m):
    for tf, tb in ((1, 2), (2, 3)):
        for schedule in (pp.gpipe, pp.one_f_one_b):
            assert abs(pp.simulate(schedule(p, m), tf, tb).bubble_fraction - pp.bubble_1f1b(p, m)) < 1e-12
        assert pp.simulate(pp.one_f_one_b(p, m), tf, tb).peak_inflight == [min(p - s, m) for s in range(p)]
        assert pp.simulate(pp.gpipe(p, m), tf, tb).peak_inflight == [m] * p


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (3, 6, 3)])
def test_interleaved_bubble(p, m, v):
    t = pp.simulate(pp.interleaved_1f1b(p, m, v), 1, 2, v=v)
    assert abs(t.bubble_fraction - pp.bubble_interleaved(p, m, v)) < 1e-12


@pytest.mark.parametrize("tf,tb,tw", [(1, 1, 1), (1, 2, 1), (2, 3, 0.5), (1, 1, 0)])
def test_zb_h1_bubble_inside_its_range(tf, tb, tw):
    for p, m in ((2, 2), (4, 8)):
        t = pp.simulate(pp.zb_h1(p, m), tf, tb, tw)
        assert abs(t.bubble_fraction - pp.bubble_zb_h1(p, m, tf, tb, tw)) < 1e-12
        assert max(t.peak_inflight) == p


@pytest.mark.parametrize("tf,tb,tw", [(1, 1, 1.5), (2, 1, 1.5), (1, 1, 3)])
def test_zb_h1_formula_refuses_a_long_w(tf, tb, tw):
    # outside T_W <= min(T_F, T_B) the count (p-1)(T_F+T_B-T_W) undershoots what the schedule does
    idle = 3 * (tf + tb - tw)
    assert pp.simulate(pp.zb_h1(4, 8), tf, tb, tw).bubble_fraction > idle / (8 * (tf + tb + tw) + idle) + 0.01
    with pytest.raises(ValueError, match="t_w <= min"):
        pp.bubble_zb_h1(4, 8, tf, tb, tw)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="t_f > 0"):
        pp.bubble_zb_h1(4, 8, 0, 1, 0)
    with pytest.raises(ValueError, match="m \\(micro-batches\\)"):
        pp.one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="multiple of p"):
        pp.interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="at least as many"):
        pp.zb_h1(4, 2)


def test_an_order_without_warm_up_deadlocks():
    # stage 0 of 4 alternating F and B at once: its B 0 waits for stage 1's B 0, which 1F1B runs after
    # stage 1's F 1, which waits for stage 0's F 1, queued behind that B 0
    assert pp.simulate(pp.one_f_one_b(4, 4)).makespan == (4 + 4 - 1) * 3     # (m + p - 1)(T_F + T_B)
    orders = pp.one_f_one_b(4, 4)
    orders[0] = [op for i in range(4) for op in (pp.Op("F", i), pp.Op("B", i))]
    with pytest.raises(pp.ScheduleDeadlock):
        pp.simulate(orders)



@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_v_reaches_the_lower_bound_within_1f1b_memory(p):
    # equal whole-stage times 1 (chunk ops 1/2): no step can be shorter than the last rank's wait for
    # its first input, (p - 1) chunk forwards, plus its 6m chunk ops; the V order reaches it for m >= 2p
    for m in (2 * p, 2 * p + 1, 3 * p + 2):
        t = pp.simulate(pp.zb_v(p, m), 1, 1, 1, v=2, placement="v")
        assert t.makespan == (p - 1) / 2 + 3 * m
        assert abs(t.bubble_fraction - pp.bubble_zb_v(p, m)) < 1e-12
        assert max(t.peak_inflight) <= 2 * p                 # 2p chunk activations = 1F1B's p stages
    for m in range(1, 2 * p):                                 # fewer micro-batches: still completes
        pp.simulate(pp.zb_v(p, m), 1, 1, 1, v=2, placement="v")


def test_zb_v_broken_orders_are_caught():
    orders = pp.zb_v(4, 8)
    with pytest.raises(pp.ScheduleDeadlock):                  # the same orders on Megatron's placement
        pp.simulate(orders, 1, 1, 1, v=2)
    eager = [[op for o in order if o.kind != "W" for op in ((o, pp.Op("W", o.mb, o.chunk)) if o.kind == "B" else (o,))]
             for order in orders]                            # every W right after its B: no gaps filled
    t = pp.simulate(eager, 1, 1, 1, v=2, placement="v")
    assert t.bubble_fraction > pp.bubble_zb_v(4, 8) + 0.1
    with pytest.raises(ValueError, match="two chunks"):
        pp.simulate(orders, v=3, placement="v")
    with pytest.raises(ValueError, match="m >= 2p"):
        pp.bubble_zb_v(4, 7)


def test_dualpipe_formula_is_the_readme_table():
    # deepseek-ai/DualPipe README: (PP/2 - 1)(F&B + B - 3W); without overlap F&B = F + B
    assert pp.bubble_dualpipe(8, 1, 2, 1) == 3 * (1 + 2 + 2 - 3)
    assert pp.bubble_dualpipe(8, 1, 2, 1, t_fb=2) == 3 * (2 + 2 - 3)
    assert pp.bubble_dualpipe(2, 1, 2, 1) == 0
    for bad in ((7, 1, 2, 1), (8, 1, 2, 3)):
        with pytest.raises(ValueError):
            pp.bubble_dualpipe(*bad)
    with pytest.raises(ValueError, match="t_fb"):
        pp.bubble_dualpipe(8, 1, 2, 1, t_fb=3.5)


# ---------------------------------------------------------------- the real pipeline over 2 ranks

@pytest.fixture(scope="module")
def run():
    return launch(pp.pipeline_worker, P, (B, T, M, STEPS), timeout=120, preload=("torch._dynamo",))


@pytest.fixture(scope="module")
def reference():
    return pp.reference_training(B, T, STEPS)


def _gathered(run, label, key):
    out = {}
    for res in run.results:
        out.update(res[label][key])
    return out


def test_1f1b_trains_as_one_process(run, reference):
    losses = run.results[-1]["1f1b"]["losses"]
    assert len(losses) == STEPS and all(abs(a - b) < 1e-8 for a, b in zip(losses, reference["losses"]))
    grads = _gathered(run, "1f1b", "grads")
    assert set(grads) == set(reference["grads"])
    assert pp.max_rel_diff(grads, reference["grads"]) < REL
    assert pp.max_rel_diff(_gathered(run, "1f1b", "params"), reference["params"]) < REL
    assert pp.max_rel_diff(_gathered(run, "gpipe", "grads"), reference["grads"]) < REL


def test_missing_tied_embedding_all_reduce_is_caught(run, reference):
    assert pp.max_rel_diff(_gathered(run, "no_tied_sync", "grads"), reference["grads"]) > 0.1


def test_bytes_and_in_flight_counts(run):
    act = (B // M) * T * C * E                                      # one micro-batch's activation
    for label in ("1f1b", "gpipe"):
        assert [res[label]["stats"].bytes_sent for res in run.results] == [M * act, M * act]
    assert [res["1f1b"]["stats"].peak_inflight for res in run.results] == [2, 1]
    assert [res["gpipe"]["stats"].peak_inflight for res in run.results] == [M, M]
    assert run.results[0]["1f1b"]["stats"].ops == pp.one_f_one_b(P, M)[0]
