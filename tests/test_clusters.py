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
