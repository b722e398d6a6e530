"""kernels/gpu/clusters.py and kernels/cuda/cluster_reduce.cu: the cluster reduction under two
adversarial schedules (each barrier shown necessary), the cluster limits, the SASS of the cluster
and DSM instructions per target, and on a GPU the kernel against the reference."""
import pytest
import torch

import kernels  # noqa: F401
from kernels import inspect as ki
from kernels import runtime
from kernels.gpu import clusters as CL
from kernels.gpu import hardware as hw
from kernels.ptx import sass as S
from kernels.testing import assert_close

_SKIP = pytest.mark.skipif(not runtime.runtime().on_gpu, reason="needs a CUDA GPU: cluster_reduce.cu is compiled and its "
                           "SASS asserted on the CPU, but launching it needs a driver and an sm90+ device")


def GPU(fn):
    return pytest.mark.gpu(_SKIP(fn))


def ints(n, seed):
    return torch.randint(-50, 51, (n,), generator=torch.Generator().manual_seed(seed)).double()


@pytest.mark.parametrize("cluster, n_per_block, clusters", [(1, 7, 3), (2, 100, 1), (4, 33, 5), (8, 16, 2), (16, 3, 1)])
@pytest.mark.parametrize("schedule", ["leader_first", "followers_first"])
def test_cluster_sum_is_exact_under_both_schedules(cluster, n_per_block, clusters, schedule):
    x = ints(cluster * n_per_block * clusters, cluster + n_per_block)
    assert torch.equal(CL.cluster_sum(x, cluster, n_per_block, schedule=schedule), CL.cluster_sum_ref(x, cluster, n_per_block))


def test_cluster_sum_random_values():
    x = torch.randn(4 * 4 * 250, dtype=torch.float64)
    assert_close(CL.cluster_sum(x, 4, 250), CL.cluster_sum_ref(x, 4, 250), dtype=torch.float64)


def test_without_barrier_1_the_leader_reads_unwritten_partials():
    x = ints(4 * 64 * 2, 1)
    assert torch.isnan(CL.cluster_sum(x, 4, 64, skip=1)).all()                      # leader first: NaN partials
    assert torch.equal(CL.cluster_sum(x, 4, 64, skip=1, schedule="followers_first"),  # the other schedule hides it
                       CL.cluster_sum_ref(x, 4, 64))


def test_without_barrier_2_the_leader_reads_an_exited_block():
    x = ints(4 * 64, 2)
    with pytest.raises(CL.DSMError, match="rank 1, which has exited"):
        CL.cluster_sum(x, 4, 64, skip=2, schedule="followers_first")
    assert torch.equal(CL.cluster_sum(x, 4, 64, skip=2), CL.cluster_sum_ref(x, 4, 64))   # hidden by leader first


def test_cluster_sum_bad_inputs():
    with pytest.raises(ValueError, match="multiple of cluster"):
        CL.cluster_sum(torch.zeros(100), 4, 30)
    with pytest.raises(ValueError, match="cluster must be 1..16"):
        CL.cluster_sum(torch.zeros(32), 32, 1)
    with pytest.raises(ValueError, match="schedule must be"):
        CL.cluster_sum(torch.zeros(8), 4, 2, schedule="random")


def test_cluster_limits():
    assert hw.MAX_CLUSTER_SIZE_PORTABLE == 8 and hw.MAX_CLUSTER_SIZE_NONPORTABLE["sm90"] == 16


@pytest.fixture(scope="module")
def builds():
    return {arch: ki.compile_cuda("cluster_reduce", arch=arch) for arch in ("sm90", "sm100", "sm120")}


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm120"])
def test_cluster_sass(builds, arch):
    b = builds[arch]
    ptx = ki.instructions(b.ptx, "ptx")
    assert ptx["mapa.shared::cluster.u32"] == 1 and ptx["ld.shared::cluster.f32"] == 1
    assert ptx["barrier.cluster.arrive.release.aligned"] == 2 and ptx["barrier.cluster.wait.acquire.aligned"] == 2
    ops = S.opcodes(b.sass, "cluster_sum")
    assert ops["UCGABAR_ARV"] == 2 and ops["UCGABAR_WAIT"] == 2          # the two cluster barriers
    assert ops["CCTL.IVALL"] == 2 and ops["MEMBAR.ALL.GPU"] == 2         # acquire invalidates L1, release fences
    assert ops["LD.E"] == 1                                              # the DSM read: a generic load
    fn = S.split_functions(b.sass)["cluster_sum"]
    assert "SR_SWINHI" in fn                                            # mapa: built from the shared window
    assert b.metadata["resources"]["cluster_sum"]["LOCAL"] == 0


def test_clusters_need_sm90():
    with pytest.raises(ki.CompileError, match="__cluster_dims__ is not supported"):
        ki.compile_cuda("cluster_reduce", arch="sm80")


@GPU
@pytest.mark.parametrize("clusters", [1, 3, 66])
def test_gpu_cluster_sum(clusters):
    from kernels import cuda_launch

    mod = cuda_launch.load("cluster_reduce")
    n = 1000
    x = torch.randn(clusters * 4 * n, device="cuda")
    out = torch.empty(clusters, device="cuda")
    mod.launch("cluster_sum", clusters * 4, 256, x, out, n, 0)
    assert_close(out.cpu(), CL.cluster_sum_ref(x.cpu(), 4, n), dtype=torch.float32,
                 baseline=x.cpu().reshape(clusters, -1).sum(1))


# ---------------------------------------------------------------------------------------------
# kernels/cuda/cluster_multicast.cu: a multicast ring released by remote arrives, and st.async /
# red.async pushes into a peer's shared memory


@pytest.mark.parametrize("cluster", [2, 4])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("schedule", ["leader_first", "followers_first"])
def test_multicast_ring_is_exact_when_every_block_releases(cluster, stages, schedule):
    x = ints(7 * 33, cluster + stages).reshape(7, 33)                    # 7 tiles: several rounds of every slot
    scale = torch.arange(1.0, cluster + 1)
    assert torch.equal(CL.multicast_sums(x, scale, stages=stages, schedule=schedule), CL.multicast_sums_ref(x, scale))


@pytest.mark.parametrize("schedule", ["leader_first", "followers_first"])
def test_multicast_ring_with_too_few_releases_overwrites_a_slot_a_peer_still_needs(schedule):
    x = ints(7 * 33, 5).reshape(7, 33)
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for count in (1, 3):                 # rank 0's own release only; or every block but one
        got = CL.multicast_sums(x, scale, stages=2, empty_count=count, schedule=schedule)
        assert not torch.equal(got, CL.multicast_sums_ref(x, scale))


def test_multicast_bad_inputs():
    with pytest.raises(ValueError, match="n_tiles, tile"):
        CL.multicast_sums(torch.zeros(8), torch.ones(2))
    with pytest.raises(ValueError, match="stages"):
        CL.multicast_sums(torch.zeros(2, 4), torch.ones(2), stages=0)
    with pytest.raises(ValueError, match="schedule must be"):
        CL.multicast_sums(torch.zeros(2, 4), torch.ones(2), schedule="random")


@pytest.fixture(scope="module")
def multicast_builds():
    return {arch: ki.compile_cuda("cluster_multicast", arch=arch) for arch in ("sm90", "sm100", "sm120")}


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm120"])
def test_multicast_and_remote_arrive_sass(multicast_builds, arch):
    b = multicast_builds[arch]
    ptx = b.ptx
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster" in ptx
    assert "mbarrier.arrive.release.cluster.shared::cluster.b64" in ptx
    ops = S.opcodes(b.sass, "cluster_multicast_sums")
    assert ops["SYNCS.ARRIVE.TRANS64.RED.A1T0"] == 1                     # the arrive on rank 0's empty[s]
    if arch == "sm120":                  # no multicast instruction: ptxas emits a call in its place
        assert ops["UBLKCP.S.G.MULTICAST"] == 0 and ops["CALL.ABS.NOINC"] == 1
    else:
        assert ops["UBLKCP.S.G.MULTICAST"] == 1 and ops["CALL.ABS.NOINC"] == 0


@pytest.mark.parametrize("arch", ["sm90", "sm100", "sm120"])
def test_st_async_and_red_async_sass(multicast_builds, arch):
    ops = S.opcodes(multicast_builds[arch].sass, "cluster_sum_push")
    assert ops["STAS"] == 1 and ops["REDAS.ADD"] == 1                    # st.async, red.async.add
    assert ops["UCGABAR_ARV"] == 1 and ops["UCGABAR_WAIT"] == 1          # one cluster barrier (after init), not two
    assert ops["LD.E"] == 0                                              # no DSM read: the data was pushed


@GPU
@pytest.mark.parametrize("n_tiles", [1, 2, 7])
def test_gpu_cluster_multicast_sums(n_tiles):
    from kernels import cuda_launch

    mod = cuda_launch.load("cluster_multicast")
    blocks, tile = 6, 1024                                               # 3 clusters of 2
    x = torch.randn(n_tiles, tile, device="cuda")
    scale = torch.randn(blocks, device="cuda")
    out = torch.empty(blocks, n_tiles, device="cuda")
    mod.launch("cluster_multicast_sums", blocks, 128, x, scale, out, n_tiles)
    want = CL.multicast_sums_ref(x.cpu(), scale.cpu())
    assert_close(out.cpu(), want, dtype=torch.float32, baseline=scale.cpu()[:, None] * x.cpu().sum(1)[None, :])


@GPU
def test_gpu_cluster_sum_push():
    from kernels import cuda_launch

    mod = cuda_launch.load("cluster_multicast")
    clusters, n = 5, 1000
    x = torch.randn(clusters * 2 * n, device="cuda")
    out = torch.empty(clusters, device="cuda")
    count = torch.zeros(clusters, dtype=torch.int32, device="cuda")
    mod.launch("cluster_sum_push", clusters * 2, 128, x, out, count, n)
    assert_close(out.cpu(), CL.cluster_sum_ref(x.cpu(), 2, n), dtype=torch.float32,
                 baseline=x.cpu().reshape(clusters, -1).sum(1))
    assert torch.equal(count.cpu(), (x.cpu().reshape(clusters, -1) > 0).sum(1).int())


@pytest.mark.parametrize("cluster, n_per_block, clusters", [(1, 7, 2), (2, 64, 3), (4, 33, 2), (16, 3, 1)])
@pytest.mark.parametrize("schedule", ["leader_first", "followers_first"])
def test_push_sum_is_exact_under_both_schedules(cluster, n_per_block, clusters, schedule):
    x = ints(cluster * n_per_block * clusters, cluster * 7 + n_per_block)
    sums, counts = CL.push_sum(x, cluster, n_per_block, schedule=schedule)
    want_sums, want_counts = CL.push_sum_ref(x, cluster, n_per_block)
    assert torch.equal(sums, want_sums) and torch.equal(counts, want_counts)


def test_push_sum_expecting_too_few_bytes_reads_early_or_hangs():
    x = ints(4 * 33, 9)
    want_sums, want_counts = CL.push_sum_ref(x, 4, 33)
    sums, counts = CL.push_sum(x, 4, 33, expect_bytes=24)              # one block's 8 bytes short
    assert torch.isnan(sums).all()                                      # a slot read before its st.async landed
    sums, counts = CL.push_sum(x, 4, 33, expect_bytes=28)              # the last red.async not waited for
    assert torch.equal(sums, want_sums) and not torch.equal(counts, want_counts)
    with pytest.raises(RuntimeError, match="deadlock"):                 # bytes already landed: tx never returns to 0
        CL.push_sum(x, 4, 33, expect_bytes=24, schedule="followers_first")
    with pytest.raises(RuntimeError, match="deadlock"):                 # more bytes than anyone sends
        CL.push_sum(x, 4, 33, expect_bytes=40)


def test_push_sum_bad_inputs():
    with pytest.raises(ValueError, match="multiple of cluster"):
        CL.push_sum(torch.zeros(10), 4, 2)
    with pytest.raises(ValueError, match="schedule must be"):
        CL.push_sum(torch.zeros(8), 4, 2, schedule="random")
