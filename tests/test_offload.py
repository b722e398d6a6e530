"""kernels.moe.offload: the LRU expert cache and speculative prefetch replayed on routing traces,
the modelled time per token, the cached-expert grouped GEMM (a slot table) with its broken variant
caught, and its AOT build at a Mixtral decode step."""
import kernels  # noqa: F401  (before triton)

import pytest
import torch

from kernels import inspect as ki
from kernels.moe import offload
from kernels.moe.grouped_gemm import grouped_gemm_ref
from kernels.moe.offload import CacheStats, cached_expert_gemm, simulate, token_time
from kernels.testing import MismatchError, assert_close


def _trace(T, L, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, L, E, generator=g).argsort(-1)[..., :k]


def _lru_by_hand(seq, slots):
    """A plain LRU over one layer's token-by-token sets: hits counted the obvious way."""
    cache, hits = [], 0
    for need in seq:
        for e in need:
            if e in cache:
                hits += 1
                cache.remove(e)
            elif len(cache) >= slots:
                victim = next(c for c in cache if c not in need)
                cache.remove(victim)
            cache.append(e)
    return hits


def test_lru_matches_a_hand_written_lru():
    used = _trace(300, 2, 8, 2, 0)
    for slots in (2, 3, 5):
        stats = simulate(used, slots)
        for layer in range(2):
            assert stats[layer].hits == _lru_by_hand(used[:, layer].tolist(), slots)
            assert stats[layer].needed == 600 and stats[layer].prefetched == stats[layer].wasted == 0


def test_a_cache_of_every_expert_only_misses_once_each():
    used = _trace(200, 3, 8, 2, 1)
    for st in simulate(used, 8):
        assert st.misses == 8 and st.hit_rate == (400 - 8) / 400


def test_perfect_guesses_hide_every_miss():
    used = _trace(200, 2, 8, 2, 2)
    guessed = used.clone()
    guessed[:, 0] = -1                                     # nothing runs before layer 0
    stats = simulate(used, 2, guessed)
    assert stats[1].misses == 0 and stats[1].wasted == 0 and stats[1].prefetched + stats[1].hits == 400
    assert stats[0].misses == simulate(used, 2)[0].misses


def test_wrong_guesses_are_counted_as_wasted_copies():
    used = torch.tensor([[[0, 1]], [[0, 1]]])
    guessed = torch.tensor([[[2, 3]], [[2, 3]]])
    st = simulate(used, 4, guessed)[0]
    assert (st.hits, st.prefetched, st.misses, st.wasted) == (2, 0, 2, 2)


def test_token_time_model():
    """Misses cost a full copy; prefetches only what the previous layer's compute does not cover."""
    st = CacheStats(hits=0, prefetched=0, misses=2, wasted=0, tokens=1)
    assert token_time([st], 1e9, 10.0, 0.01, hidden_s_per_layer=0.01) == pytest.approx(0.01 + 0.2)
    ahead = CacheStats(hits=0, prefetched=2, misses=0, wasted=0, tokens=1)
    assert token_time([ahead], 1e9, 10.0, 0.5, hidden_s_per_layer=0.5) == pytest.approx(0.5)            # hidden
    assert token_time([ahead], 1e9, 10.0, 0.5, hidden_s_per_layer=0.05) == pytest.approx(0.5 + 0.15)    # only attention hides it
    with pytest.raises(ValueError, match="hidden_s_per_layer"):
        token_time([ahead], 1e9, 10.0, 0.5, hidden_s_per_layer=-1.0)


def test_cached_expert_gemm_matches_the_full_weights_and_the_broken_variant_is_caught():
    g = torch.Generator().manual_seed(3)
    E, K, N = 8, 24, 40
    w = torch.randn(E, K, N, generator=g)
    x = torch.randn(5, K, generator=g)
    loads = [0, 3, 0, 0, 4, 0, 3, 0]                      # experts 1, 4, 6 are used
    offsets = torch.zeros(E + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(loads).cumsum(0)
    rows = torch.randint(0, 5, (10,), generator=g)
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[torch.tensor([6, 1, 4])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    cache = torch.stack([w[6], w[1], w[4]])
    want = grouped_gemm_ref(x, w, offsets, rows)
    assert_close(cached_expert_gemm(x, cache, slot_of, offsets, rows=rows), want)
    identity = torch.arange(E, dtype=torch.int32).clamp(max=2)                 # broken: the expert id as the slot
    with pytest.raises(MismatchError):
        assert_close(offload.gg._forward(x, cache, rows, offsets, 10, slot_of=identity), want)
    with pytest.raises(ValueError, match=r"experts \[4\] have rows but no cache slot"):
        cached_expert_gemm(x, cache, torch.where(torch.arange(E) == 4, -1, slot_of).int(), offsets, rows=rows)


def test_bad_input_refused():
    used = _trace(10, 2, 8, 2, 4)
    with pytest.raises(ValueError, match="at least k=2"):
        simulate(used, 1)
    with pytest.raises(ValueError, match=r"\(T, L, k\)"):
        simulate(used[0], 2)
    with pytest.raises(ValueError, match="guessed must have"):
        simulate(used, 2, used[:5])


def test_trace_of_the_committed_model():
    """The top-2 model's trace: decode order, layer 0 unguessed, layer 1's guess mostly right."""
    from kernels.model import data
    from kernels.moe import train

    model = train.load_checkpoint()
    _, val = data.train_val_split(data.encode(data.load_text()))
    x, _ = data.fixed_windows(val, 4, model.config.block_size)
    used, guessed = offload.routing_trace(model, x)
    assert used.shape == (4 * 64, 2, 2) and bool((guessed[:, 0] == -1).all())
    overlap = (guessed[:, 1, :, None] == used[:, 1, None, :]).any(-1).float().mean()
    assert float(overlap) > 0.6
    _, early = offload.routing_trace(model, x, guess_from="moe")        # one state older: a worse guess
    early_right = (early[:, 1, :, None] == used[:, 1, None, :]).any(-1).float().mean()
    assert bool((early[:, 0] == -1).all()) and 0.3 < float(early_right) < float(overlap)
    with pytest.raises(ValueError, match="guess_from"):
        offload.routing_trace(model, x, guess_from="attention")


def test_aot_build_at_a_mixtral_decode_step():
    jobs = offload.compile_jobs()
    (build,) = [b["sm90"] for b in ki.compile_triton_many(list(jobs.values()), archs=("sm90",))]
    assert build.spills == 0 and build.tensor_core == "HGMMA"


def test_repeat_rates_count_pairs_within_sequences():
    """Two sequences of 3 tokens (top-2, first choice first): the pair across the boundary is not counted."""
    used = torch.tensor([[[0, 1]], [[0, 2]], [[3, 4]],        # seq 1: (0,1)->(0,2) first and shared; ->(3,4) neither
                         [[4, 3]], [[5, 3]], [[3, 5]]])       # seq 2: (4,3)->(5,3) shared; ->(3,5) shared, not first
    first, shared = offload.repeat_rates(used, seq_len=3)
    assert float(first[0]) == 1 / 4 and float(shared[0]) == 3 / 4
    boundary_counted_first = (used[1:, 0, 0] == used[:-1, 0, 0]).double().mean()     # the broken count, 5 pairs
    assert float(boundary_counted_first) != float(first[0])


def test_random_repeats_closed_form_and_monte_carlo():
    first, shared = offload.random_repeats(8, 2)
    assert first == 1 / 8 and shared == pytest.approx(13 / 28)          # Jiang et al.'s 12.5% and 46%
    used = _trace(20000, 1, 8, 2, 5)
    mc_first, mc_shared = offload.repeat_rates(used, seq_len=20000)
    assert abs(float(mc_first[0]) - first) < 0.01 and abs(float(mc_shared[0]) - shared) < 0.015


@pytest.mark.parametrize("seed", [6, 7])
def test_lru_hit_rate_at_k_slots_lies_in_the_bounds_of_the_shared_fraction(seed):
    """At slots = k the LRU hit rate is E[shared]/k; it lies in [p/k, p] for p = P(any shared), on a
    random trace and on a sticky one (consecutive tokens often keep both experts)."""
    random_trace = _trace(3000, 1, 8, 2, seed)
    sticky = random_trace.clone()
    keep = torch.rand(3000, generator=torch.Generator().manual_seed(seed)) < 0.5
    for t in range(1, 3000):
        if keep[t]:
            sticky[t] = sticky[t - 1]
    for used in (random_trace, sticky):
        _, shared = offload.repeat_rates(used, seq_len=3000)
        lo, hi = offload.lru_hit_rate_bounds(float(shared[0]))
        assert lo <= simulate(used, 2)[0].hit_rate <= hi
    assert simulate(sticky, 2)[0].hit_rate > 0.4 > simulate(random_trace, 2)[0].hit_rate
    with pytest.raises(ValueError, match="probability"):
        offload.lru_hit_rate_bounds(1.5)


def test_published_tables_as_transcribed():
    """Mixtral's Table 5: 8 subsets x layers 0, 15, 31, each pair (first, shared) with first <= shared;
    layer 0 near random and layer 15 above it, as the paper says. Eliseev and Mazur's Table 2: every
    GPU faster with each part of the system."""
    rnd_first, rnd_shared = offload.random_repeats()
    assert len(offload.MIXTRAL_REPEATS) == 8
    for rows in offload.MIXTRAL_REPEATS.values():
        assert tuple(rows) == offload.MIXTRAL_LAYERS and all(f <= s for f, s in rows.values())
        assert abs(rows[0][0] - rnd_first) < 0.03 and rows[15][0] > rnd_first + 0.1 and rows[15][1] > rnd_shared
    for full, no_pre, no_lru, naive in offload.EM_TOKENS_PER_S.values():
        assert full > no_pre > no_lru > naive
