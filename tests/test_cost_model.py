"""The alpha-beta model: its terms, the fit recovering known parameters, the tree/ring crossover."""
import math

import pytest

from kernels.dist import cost_model as cm


def test_terms_of_each_collective():
    assert cm.ring_all_reduce_terms(800, 4) == (6, 1200.0)
    assert cm.tree_all_reduce_terms(800, 4) == (4, 3200)
    assert cm.tree_all_reduce_terms(800, 5) == (6, 4800)
    assert cm.all_gather_terms(800, 4) == (3, 600.0) == cm.reduce_scatter_terms(800, 4)
    assert cm.predict("ring", 800, 4, alpha=1.0, beta=0.5) == 6 + 600


def test_fit_recovers_alpha_and_beta():
    points = [cm.TERMS[a](n, 4) for a in ("ring", "tree") for n in (16, 1024, 65536, 2 ** 22)]
    steps, sent = zip(*points)
    t = [s * 20e-6 + b * 2e-9 for s, b in points]
    alpha, beta = cm.fit_alpha_beta(steps, sent, t)
    assert math.isclose(alpha, 20e-6, rel_tol=1e-9) and math.isclose(beta, 2e-9, rel_tol=1e-9)


def test_fit_pins_a_negative_parameter_at_zero():
    steps, sent = [2, 2, 2], [10, 100, 1000]
    t = [0.001 * b for b in sent]                # pure bandwidth: the free fit may give alpha < 0 in noise
    t[0] *= 0.5                                  # a fast small message pushes alpha negative
    alpha, beta = cm.fit_alpha_beta(steps, sent, t)
    assert alpha == 0.0 and beta > 0


def test_a_wrong_ring_term_is_caught_by_the_fit():
    """Timings made with the true 2 (p - 1)/p n bytes, fitted with a naive 2 n: beta comes out wrong."""
    points = [cm.ring_all_reduce_terms(n, 8) for n in (1024, 2 ** 20, 2 ** 24)]
    t = [s * 5e-6 + b * 1e-9 for s, b in points]
    naive = [(s, 2 * n) for (s, _), n in zip(points, (1024, 2 ** 20, 2 ** 24))]
    _, beta_naive = cm.fit_alpha_beta(*zip(*naive), t)
    assert not math.isclose(beta_naive, 1e-9, rel_tol=0.1)


def test_crossover():
    # p = 4: tree 4 alpha + 4 n beta, ring 6 alpha + 1.5 n beta -> equal at n = 0.8 alpha / beta
    assert math.isclose(cm.crossover_bytes(4, 1e-5, 1e-9), 0.8 * 1e4)
    assert cm.crossover_bytes(2, 1e-5, 1e-9) == 0.0      # p = 2: same 2 rounds, but the tree sends n, not n/2: never better


def test_bad_input():
    with pytest.raises(ValueError, match="p must be a positive int"):
        cm.ring_all_reduce_terms(10, 0)
    with pytest.raises(ValueError, match="algo must be one of"):
        cm.predict("mesh", 10, 4, 1, 1)
    with pytest.raises(ValueError, match="seconds must be positive"):
        cm.fit_alpha_beta([1, 2], [1, 2], [0, 1])


def _all_to_all_by_peer(sent, p, g, b_in, b_out):
    """Independent count: walk every peer of rank 0, add its piece to the NVLink or NIC leg."""
    piece = sent / (p - 1)
    local = sum(piece for q in range(1, p) if q // g == 0)
    remote = sum(piece for q in range(1, p) if q // g != 0)
    return max(local / (b_in * 1e9), remote / (b_out * 1e9))


def test_all_to_all_split_between_nvlink_and_nic():
    for p in (2, 8, 16, 32):
        got = cm.all_to_all_seconds(1.5e6, p, 8, 450, 50)
        assert math.isclose(got, _all_to_all_by_peer(1.5e6, p, 8, 450, 50), rel_tol=1e-12), p
    assert math.isclose(cm.all_to_all_seconds(15e6, 16, 8, 450, 50), 8e6 / 50e9)       # 8 of 15 pieces leave
    # a broken model that prices everything at NVLink (one node of p GPUs) is 9x too fast at p = 16
    nvlink_only = 15e6 / 450e9
    assert cm.all_to_all_seconds(15e6, 16, 8, 450, 50) > 4 * nvlink_only
    assert cm.all_to_all_seconds(15e6, 16, 16, 450, 50) == nvlink_only                 # an NVL-16 domain
    assert cm.all_to_all_seconds(15e6, 1, 8, 450, 50) == 0.0
    with pytest.raises(ValueError, match="do not fill whole nodes"):
        cm.all_to_all_seconds(1.0, 12, 8, 450, 50)
    with pytest.raises(ValueError, match="node_gpus"):
        cm.all_to_all_seconds(1.0, 8, 0, 450, 50)
