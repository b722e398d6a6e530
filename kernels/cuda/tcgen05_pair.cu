// The CTA pair (cta_group::2): one thread of one CTA issues an M = 256 MMA for two CTAs.
//
// PTX ISA (nvidia2025ptx), "TensorCore 5th Generation Family Instructions", .cta_group::2: the two
// CTAs of a cluster whose ranks differ only in bit 0 form a pair. Issue model, as this kernel does it:
//   - alloc/dealloc/relinquish_alloc_permit .cta_group::2: warp 0 of EACH CTA executes them; the columns
//     are allocated at the same address in both CTAs' TMEM;
//   - each CTA stages its own operands at the same shared-memory offsets: rows 128r..128r+127 of A and
//     half of B (N/2 rows of B^T); the cluster barrier makes both halves ready;
//   - ONE thread of the even CTA (the leader) issues tcgen05.mma.cta_group::2: the descriptors name
//     offsets that the tensor cores read in both CTAs' shared memory, and each CTA's TMEM receives its
//     128 rows of D for all N columns;
//   - the leader's tcgen05.commit.cta_group::2 ... multicast::cluster arrives on the mbarrier at the same
//     offset in every CTA of the mask (0b11 = both), so each CTA waits on its own barrier and reads its
//     own TMEM with tcgen05.ld (warp w: lanes 32(w%4)..).
// Compiled for its SASS (kernels/ptx/tcgen05.py: pair_mma emulates the data split, not this issue).
// D_r (128 x N f32, N = 64) = A_r (128 x 16) B (16 x N); A: 256 x 16 row-major; Bt: N x 16 row-major.
#include <cstdint>
#include <cuda_fp16.h>

#define N 64

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint64_t make_smem_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16)
         | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 46);
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(128)
tcgen05_pair_gemm(const __half* A, const __half* Bt, float* D, uint32_t idesc) {
    __shared__ __align__(1024) __half As[128 * 16];
    __shared__ __align__(1024) __half Bs[(N / 2) * 16];
    __shared__ __align__(8) uint64_t bar;
    __shared__ uint32_t tmem_base;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    for (int i = threadIdx.x; i < 128 * 2; i += 128) {             // 16-byte core-matrix rows, K-blocks outermost
        const int r = i / 2, kb = i % 2;
        reinterpret_cast<uint4*>(As)[kb * 128 + r] = reinterpret_cast<const uint4*>(A + (size_t)(128 * rank) * 16)[i];
        if (r < N / 2) reinterpret_cast<uint4*>(Bs)[kb * (N / 2) + r] = reinterpret_cast<const uint4*>(Bt + (size_t)(N / 2 * rank) * 16)[i];
    }
    if (warp == 0) {                                               // both CTAs: one warp each
        asm volatile("tcgen05.alloc.cta_group::2.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(smem_addr(&tmem_base)), "r"(N));
        asm volatile("tcgen05.relinquish_alloc_permit.cta_group::2.sync.aligned;\n");
    }
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&bar)));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
    cluster_sync();                                                // both CTAs' operands and barriers exist
    asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
    const uint32_t tmem = tmem_base;
    if (rank == 0 && threadIdx.x == 0) {                           // the leader issues for the pair
        const uint64_t da = make_smem_desc(smem_addr(As), 128 * 16, 128);
        const uint64_t db = make_smem_desc(smem_addr(Bs), (N / 2) * 16, 128);
        asm volatile("tcgen05.mma.cta_group::2.kind::f16 [%0], %1, %2, %3, 0;\n" ::"r"(tmem), "l"(da), "l"(db), "r"(idesc) : "memory");
        asm volatile("tcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster.multicast::cluster.b64 [%0], %1;\n"
                     ::"r"(smem_addr(&bar)), "h"((unsigned short)0x3) : "memory");
    }
    asm volatile("{\n .reg .pred done;\nWAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
                 " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(&bar)) : "memory");
    asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
    const int row = 32 * (warp % 4) + lane;
    for (int c = 0; c < N; c += 16) {
        uint32_t v[16];
        asm volatile("tcgen05.ld.sync.aligned.32x32b.x16.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, [%16];\n"
                     : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]), "=r"(v[4]), "=r"(v[5]), "=r"(v[6]), "=r"(v[7]), "=r"(v[8]), "=r"(v[9]), "=r"(v[10]), "=r"(v[11]), "=r"(v[12]), "=r"(v[13]), "=r"(v[14]), "=r"(v[15]) : "r"(tmem + ((uint32_t)(32 * (warp % 4)) << 16) + c));
        asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory");
        for (int j = 0; j < 16; ++j) D[(size_t)(128 * rank + row) * N + c + j] = __uint_as_float(v[j]);
    }
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
    cluster_sync();                                                // the peer is done with both TMEM halves
    if (warp == 0) asm volatile("tcgen05.dealloc.cta_group::2.sync.aligned.b32 %0, %1;\n" ::"r"(tmem), "r"(N));
}
