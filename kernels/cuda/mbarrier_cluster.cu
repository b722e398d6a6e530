// An mbarrier in one CTA, arrived on from another CTA of the cluster, with release/acquire at
// cluster scope and try_wait's suspend-time hint (PTX ISA, "mbarrier.arrive" and
// "mbarrier.test_wait/mbarrier.try_wait": the .release/.acquire semantics and .cta/.cluster scopes;
// the .shared::cluster state space for a peer CTA's barrier, addressed through mapa).
//
// Kernel mbarrier_remote_arrive: a cluster of 2 CTAs of 64 threads. Each thread of CTA 1 stores a
// value into CTA 0's shared array (st.shared::cluster) and arrives on CTA 0's barrier with
// mbarrier.arrive.release.cluster; the release orders its store before its arrival. The threads of
// CTA 0 wait with mbarrier.try_wait.parity.acquire.cluster (the acquire orders their later reads
// after the phase completes), passing suspend_ns: the time a thread may be suspended inside one
// try_wait before it returns false (a hint; 0 = the system's default). out[t] = 3 t + 1 for t < 64.
// With release=0 the arrive is .relaxed: nothing orders the store before the arrival, a data race.
#include <cstdint>

#define THREADS 64

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ unsigned peer_addr(const void* p, unsigned rank) {   // mapa: my address in CTA `rank`
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr(p)), "r"(rank));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS)
mbarrier_remote_arrive(int* __restrict__ out, unsigned suspend_ns, int release) {
    __shared__ int data[THREADS];
    __shared__ __align__(8) uint64_t ready;
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(&ready)), "r"(THREADS) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");   // the init, visible cluster-wide
    }
    cluster_sync();                                       // no peer arrives before the barrier exists
    if (rank == 1) {
        asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(peer_addr(&data[threadIdx.x], 0)), "r"(3 * threadIdx.x + 1)
                     : "memory");
        if (release)
            asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(peer_addr(&ready, 0))
                         : "memory");
        else
            asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(peer_addr(&ready, 0))
                         : "memory");
    } else {
        asm volatile("{\n .reg .pred done;\nWAIT_%=:\n"
                     " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1, %2;\n"
                     " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(&ready)), "r"(0), "r"(suspend_ns) : "memory");
        out[threadIdx.x] = data[threadIdx.x];
    }
    cluster_sync();                                       // CTA 0's shared memory outlives every remote access
}
