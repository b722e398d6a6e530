"""kernels/ptx/mbarrier.py and kernels/cuda/mbarrier.cu: the mbarrier state machine against the
PTX ISA's rules, the producer/consumer ring (races and the wrong-parity deadlock), the SASS per
target, and on a GPU the kernel against the reference."""
import math
import random

import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels import runtime
from kernels.ptx import cp_async as ca
from kernels.ptx import mbarrier as M
from kernels.ptx import sass as S
from kernels.testing import assert_close

_SKIP_CPU = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA GPU: the kernel is compiled and its "
                               "SASS asserted on the CPU, but launching it needs a driver and an sm90+ device")


def GPU(fn):
    return pytest.mark.gpu(_SKIP_CPU(fn))


# ---------------------------------------------------------------------------------------------
# The state machine, rule by rule (PTX ISA, "mbarrier": contents, phase completion, tx-count, try_wait)


def test_init_state_and_the_preceding_phase_counts_as_complete():
    bar = M.MBarrier(3)
    assert bar.state() == (0, 3, 0)
    assert not bar.try_wait_parity(0)      # the current phase (parity 0) is running
    assert bar.try_wait_parity(1)          # parity 1 names the phase before it: complete


def test_arrivals_complete_a_phase_and_reset_the_pending_count():
    bar = M.MBarrier(2)
    assert bar.arrive() == 0 and bar.state() == (0, 1, 0)
    assert bar.arrive() == 0 and bar.state() == (1, 2, 0)   # pending reset to the expected count
    assert bar.try_wait_parity(0) and not bar.try_wait_parity(1)
    bar.arrive(2)
    assert bar.state() == (2, 2, 0) and bar.try_wait_parity(1)


def test_a_phase_waits_for_its_bytes_as_well_as_its_arrivals():
    bar = M.MBarrier(1)
    bar.arrive_expect_tx(4096)
    assert bar.state() == (0, 0, 4096) and not bar.try_wait_parity(0)   # arrived, but 4 KiB owed
    bar.complete_tx(1024)
    assert bar.state() == (0, 0, 3072)
    bar.complete_tx(3072)
    assert bar.state() == (1, 1, 0) and bar.try_wait_parity(0)


def test_bytes_may_land_before_they_are_expected():
    bar = M.MBarrier(1)
    bar.complete_tx(512)                   # the tx-count goes negative; arrivals are still pending
    assert bar.state() == (0, 1, -512)
    bar.expect_tx(512)
    assert bar.state() == (0, 1, 0)        # not complete: the arrival is missing
    bar.arrive()
    assert bar.state() == (1, 1, 0)


def test_arrivals_alone_do_not_complete_while_bytes_are_owed():
    bar = M.MBarrier(2)
    bar.expect_tx(16)
    bar.arrive(2)
    assert bar.state() == (0, 0, 16)
    with pytest.raises(M.MBarrierError, match="no effect for more arrivals"):
        bar.arrive()


def test_arrive_no_complete_must_not_complete_the_phase():
    bar = M.MBarrier(4)
    bar.arrive(3, no_complete=True)                 # 4 -> 1 pending: allowed
    assert bar.state() == (0, 1, 0)
    with pytest.raises(M.MBarrierError, match="noComplete.*would complete phase 0"):
        bar.arrive(1, no_complete=True)
    bar.expect_tx(16)
    bar.arrive(1, no_complete=True)                 # bytes still owed: the phase does not complete
    assert bar.state() == (0, 0, 16)


@pytest.mark.parametrize("expected", [1, 3, 7, 128])
@pytest.mark.parametrize("seed", range(3))
def test_arrival_sequences_agree_with_a_closed_form(expected, seed):
    # independent encoding: after T arrivals, T // E phases are complete and E - T % E are pending
    rng = random.Random(seed)
    bar, total = M.MBarrier(expected), 0
    for _ in range(200):
        n = rng.randint(1, bar.pending)
        bar.arrive(n)
        total += n
        assert bar.state() == (total // expected, expected - total % expected, 0)
        for p in (0, 1):
            assert bar.try_wait_parity(p) == ((total // expected) % 2 != p)


def test_ranges_and_bad_arguments():
    with pytest.raises(M.MBarrierError, match="count must be in 1..1048575"):
        M.MBarrier(0)
    with pytest.raises(M.MBarrierError, match="count must be"):
        M.MBarrier(2**20)
    M.MBarrier(2**20 - 1)
    bar = M.MBarrier(1)
    bar.expect_tx(2**20 - 1)
    with pytest.raises(M.MBarrierError, match="tx-count"):
        bar.expect_tx(1)
    with pytest.raises(M.MBarrierError, match="tx-count"):
        M.MBarrier(1).complete_tx(2**20)
    with pytest.raises(ValueError, match="parity must be 0 or 1"):
        bar.try_wait_parity(2)


# ---------------------------------------------------------------------------------------------
# The ring of kernels/cuda/mbarrier.cu


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("consumers", [1, 2, 3])
def test_ring_sums_match_the_reference(stages, consumers):
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(stages * 10 + consumers), dtype=torch.float64)
    for n in (0, 1, stages, 11):           # no tiles, one tile, exactly one round, several rounds with a tail
        assert torch.equal(M.ring_sums(x[:n], stages, consumers).out, M.ring_sums_ref(x[:n]))


def test_consumer_on_the_wrong_parity_reads_before_the_bytes_land():
    x = torch.randn(3, 64, dtype=torch.float64)
    out = M.ring_sums(x, 3, 2, consumer_parity_flip=True).out
    assert torch.isnan(out).all()          # waited on the preceding phase: passed at once, read NaN
    with pytest.raises(M.MBarrierError, match="more arrivals"):
        M.ring_sums(torch.randn(7, 64), 3, 2, consumer_parity_flip=True)  # and later re-arms a full slot


def test_producer_on_the_wrong_parity_deadlocks():
    with pytest.raises(M.Deadlock, match=r"producer waits on empty\[0\] parity 0"):
        M.ring_sums(torch.randn(5, 64), 3, 2, producer_parity_flip=True)


def test_ring_log_shows_the_producer_running_ahead_by_the_ring_depth():
    run = M.ring_sums(torch.randn(6, 32), 3, 1)
    first_consume = next(k for k, (who, _) in enumerate(run.log) if who.startswith("consumer"))
    assert [w for w, _ in run.log[:first_consume]].count("producer") == 3


def test_ring_bad_inputs():
    with pytest.raises(ValueError, match="x must be"):
        M.ring_sums(torch.zeros(8))
    with pytest.raises(ValueError, match="stages and consumers"):
        M.ring_sums(torch.zeros(2, 4), 0)


# ---------------------------------------------------------------------------------------------
# cp.async.mbarrier.arrive (kernels/cuda/mbarrier_cp_async.cu)


def test_cp_async_arrive_noinc_is_the_threads_arrival():
    bar, th = M.MBarrier(1), ca.AsyncCopyUnit()
    src = torch.arange(4.0)
    dst = torch.full((4,), float("nan"))
    th.cp_async(dst, src)
    th.mbarrier_arrive(bar, noinc=True)
    assert bar.state() == (0, 1, 0)              # nothing counted until the copy lands
    th.land(0)
    assert bar.state() == (1, 1, 0) and torch.equal(dst, src)


def test_cp_async_arrive_without_noinc_nets_to_zero():
    bar, th = M.MBarrier(1), ca.AsyncCopyUnit()
    th.cp_async(torch.zeros(2), torch.ones(2))
    th.mbarrier_arrive(bar, noinc=False)         # pending 1 -> 2; the landing takes it back to 1
    assert bar.state() == (0, 2, 0)
    th.land(0)
    assert bar.state() == (0, 1, 0)              # the thread's own arrival is still owed
    bar.arrive()
    assert bar.state() == (1, 1, 0)


def test_cp_async_arrive_tracks_every_prior_copy_in_any_landing_order():
    bar, th = M.MBarrier(1), ca.AsyncCopyUnit()
    for _ in range(3):
        th.cp_async(torch.zeros(1), torch.ones(1))
    th.mbarrier_arrive(bar, noinc=True)
    for i in (2, 0):
        th.land(i)
        assert bar.state() == (0, 1, 0)
    th.land(1)
    assert bar.state() == (1, 1, 0)
    with pytest.raises(ValueError, match="not in flight"):
        th.land(1)


def test_cp_async_arrive_with_nothing_in_flight_arrives_at_once():
    bar = M.MBarrier(1)
    ca.AsyncCopyUnit().mbarrier_arrive(bar, noinc=True)
    assert bar.state() == (1, 1, 0)


@pytest.mark.parametrize("arrival", ["cp.async.noinc", "cp.async+arrive"])
def test_cp_async_tile_sum_matches_the_reference(arrival):
    x = torch.randn(37, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    order = torch.randperm(37, generator=torch.Generator().manual_seed(6)).tolist()
    for land_order in (None, order):
        assert ca.cp_async_tile_sum(x, arrival, land_order) == float(x.sum())


def test_cp_async_tile_sum_broken_arrivals_are_caught():
    x = torch.randn(16, 4, dtype=torch.float64)
    assert math.isnan(ca.cp_async_tile_sum(x, "arrive"))       # plain arrive: bytes not yet landed
    with pytest.raises(M.Deadlock, match="16 arrivals still pending"):
        ca.cp_async_tile_sum(x, "cp.async")                     # no .noinc and no arrive: never completes


def test_cp_async_tile_sum_bad_inputs():
    with pytest.raises(ValueError, match="x must be"):
        ca.cp_async_tile_sum(torch.zeros(8))
    with pytest.raises(ValueError, match="arrival must be"):
        ca.cp_async_tile_sum(torch.zeros(2, 2), "arrive.noinc")
    with pytest.raises(ValueError, match="land_order must be a permutation"):
        ca.cp_async_tile_sum(torch.zeros(2, 2), land_order=[0, 0])


# ---------------------------------------------------------------------------------------------
# SASS per target


@pytest.fixture(scope="module")
def builds():
    return {arch: ki.compile_cuda("mbarrier", arch=arch) for arch in ("sm90", "sm100", "sm120")}


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm120"])
def test_mbarrier_sass(builds, arch):
    b = builds[arch]
    ptx = ki.families(b.ptx, "ptx")
    assert ptx["mbarrier.init"] >= 2 and ptx["mbarrier.try_wait"] >= 2 and ptx["cp.async.bulk"] >= 1
    ops = S.opcodes(b.sass, "mbarrier_ring_sums")
    assert ops["SYNCS.EXCH.64"] == 6                         # 2 x STAGES inits
    assert ops["SYNCS.PHASECHK.TRANS64.TRYWAIT"] >= 2        # try_wait.parity
    assert ops["SYNCS.ARRIVE.TRANS64"] >= 1                  # arrive.expect_tx (tx in a register)
    assert ops["SYNCS.ARRIVE.TRANS64.A1T0"] >= 1             # plain arrive: count 1, tx 0
    assert ops["UBLKCP.S.G"] >= 1                            # cp.async.bulk global -> shared
    assert b.metadata["resources"]["mbarrier_ring_sums"]["LOCAL"] == 0


@pytest.fixture(scope="module")
def cp_async_builds():
    return {arch: ki.compile_cuda("mbarrier_cp_async", arch=arch) for arch in ("sm80", "sm90", "sm120")}


def test_cp_async_mbarrier_arrive_sass(cp_async_builds):
    for arch, b in cp_async_builds.items():
        assert ki.families(b.ptx, "ptx")["cp.async.mbarrier"] == 1 and "cp.async.mbarrier.arrive.noinc" in b.ptx
        ops = S.opcodes(b.sass, "cp_async_arrive_sum")
        assert ops["LDGSTS.E.BYPASS.128"] == 1                      # cp.async.cg, 16 bytes
        arrive = "ARRIVES.LDGSTSBAR.64" + ("" if arch == "sm80" else ".ARVCNT")
        assert ops[arrive] == 1, (arch, sorted(ops))
        assert b.metadata["resources"]["cp_async_arrive_sum"]["LOCAL"] == 0
    sm80 = S.opcodes(cp_async_builds["sm80"].sass, "cp_async_arrive_sum")
    assert not any(op.startswith("SYNCS") for op in sm80)           # sm80: init is a store, the wait polls
    assert sm80["STS.64"] == 1
    sm90 = S.opcodes(cp_async_builds["sm90"].sass, "cp_async_arrive_sum")
    assert sm90["SYNCS.EXCH.64"] == 1 and sm90["SYNCS.PHASECHK.TRANS64"] >= 1


@pytest.fixture(scope="module")
def cluster_builds():
    return {arch: ki.compile_cuda("mbarrier_cluster", arch=arch) for arch in ("sm90", "sm100", "sm120")}


def _arrive_paths(listing):
    """The instructions guarded by each predicate of the remote-arrive branch: {"@P0": [...], "@!P0": [...]}."""
    k = next(i for i, l in enumerate(listing) if l.startswith("ST.E "))
    paths = {"@P0": [], "@!P0": []}
    for line in listing[k + 1:]:
        pred = line.split()[0]
        if pred not in paths:
            break
        paths[pred].append(line.split()[1])
    return paths


def test_cluster_mbarrier_sass(cluster_builds):
    for arch, b in cluster_builds.items():
        ptx = b.ptx
        assert "mbarrier.arrive.release.cluster.shared::cluster.b64" in ptx
        assert "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64" in ptx
        lines = S.listing(b.sass, "mbarrier_remote_arrive")
        paths = _arrive_paths(lines)
        remote = "SYNCS.ARRIVE.TRANS64.RED.A1T0"
        # release: fences (MEMBAR at GPU scope) order the remote store before the arrive; relaxed: none
        assert paths["@P0"] == ["MEMBAR.ALL.CTA", "MEMBAR.ALL.GPU", "ERRBAR", "CGAERRBAR", remote], (arch, paths)
        assert paths["@!P0"] == [remote], (arch, paths)
        # acquire: a successful wait invalidates L1 before the consumer reads
        waits = [i for i, l in enumerate(lines) if "SYNCS.PHASECHK.TRANS64.TRYWAIT" in l]
        assert waits and all("CCTL.IVALL" in lines[i + 1] or "NANOSLEEP.SYNCS" in lines[i + 1] for i in waits)
        # the suspend-time hint: a failed try_wait sleeps on the barrier for the argument's nanoseconds
        assert sum("NANOSLEEP.SYNCS" in l for l in lines) == 1
        assert b.metadata["resources"]["mbarrier_remote_arrive"]["LOCAL"] == 0


def test_mbarrier_kernel_needs_sm90():
    with pytest.raises(ki.CompileError, match="requires .target sm_90"):
        ki.compile_cuda("mbarrier", arch="sm80")


# ---------------------------------------------------------------------------------------------
# GPU


@GPU
@pytest.mark.parametrize("n_tiles", [1, 3, 10])
def test_gpu_ring_sums(n_tiles):
    from kernels import cuda_launch

    mod = cuda_launch.load("mbarrier")
    x = torch.randn(n_tiles, 1024, device="cuda")
    out = torch.empty(n_tiles, device="cuda")
    mod.launch("mbarrier_ring_sums", 1, 96, x, out, n_tiles, 0)
    assert_close(out.cpu(), M.ring_sums_ref(x.cpu()), dtype=torch.float32, baseline=x.cpu().sum(1))


@GPU
def test_gpu_wrong_parity_reads_stale_shared_memory():
    from kernels import cuda_launch

    mod = cuda_launch.load("mbarrier")
    x = torch.randn(3, 1024, device="cuda")
    out = torch.empty(3, device="cuda")
    mod.launch("mbarrier_ring_sums", 1, 96, x, out, 3, 1)   # consumers wait on the preceding phase
    assert torch.isnan(out.cpu()).any()                     # at least one tile read before its bytes


@GPU
def test_gpu_cp_async_arrive_sum():
    from kernels import cuda_launch

    mod = cuda_launch.load("mbarrier_cp_async")
    x = torch.randn(512, device="cuda")
    out = torch.full((1,), float("nan"), device="cuda")
    mod.launch("cp_async_arrive_sum", 1, 160, x, out)
    assert_close(out.cpu(), x.cpu().double().sum().reshape(1), dtype=torch.float32, baseline=x.cpu().sum().reshape(1))


@GPU
def test_gpu_remote_arrive():
    from kernels import cuda_launch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm90 or later")
    mod = cuda_launch.load("mbarrier_cluster")
    out = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    mod.launch("mbarrier_remote_arrive", 2, 64, out, 1000, 1)
    assert torch.equal(out.cpu(), 3 * torch.arange(64, dtype=torch.int32) + 1)
