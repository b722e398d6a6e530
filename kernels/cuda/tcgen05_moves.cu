// Moving data into tensor memory, and a block-scaled MMA that reads its scales from it (sm_100a).
//
// PTX ISA (nvidia2025ptx), "TensorCore 5th Generation Family Instructions":
//   tcgen05.st.32x32b.x<n>   registers -> TMEM, the inverse of tcgen05.ld.32x32b: warp w writes lanes
//                            32(w % 4) .. +31, thread t lane 32(w % 4) + t, n consecutive columns.
//   tcgen05.cp.128x256b      shared memory (through a matrix descriptor) -> TMEM, issued by one thread:
//                            128 lanes x 256 bits. Kernels use it to put scale factors into TMEM.
//   tcgen05.mma ... kind::mxf8f6f4.block_scale [d], adesc, bdesc, idesc, [scale_a], [scale_b], p:
//                            MX-format operands (8, 6 or 4-bit elements) whose per-block scale factors
//                            (one E8M0 per 32 elements along K, OCP MX) are read from TMEM.
//
// Kernel tcgen05_st_ld (128 threads): each warp stores in[thread][0..3] into its 32 lanes at columns
//   0..3 with tcgen05.st, reads them back with tcgen05.ld and writes them to out: out == in on a GPU.
//   kernels/ptx/tcgen05.py emulates both (TensorMemory.st_32x32b, ld_32x32b).
// Kernel tcgen05_scaled_mma (128 threads): allocates 128 columns, one thread copies 32 columns of scale
//   factors from shared memory with tcgen05.cp and issues one block-scaled MMA. Compiled for its SASS
//   only: the descriptors are the host's, and the MX data path is not emulated.
#include <cstdint>

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t alloc_columns(uint32_t* slot, int warp) {     // 128 columns, warp 0 allocates
    if (warp == 0) {
        asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], 128;\n" ::"r"(smem_addr(slot)));
        asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n");
    }
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
    __syncthreads();
    asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
    return *slot;
}

__device__ __forceinline__ void free_columns(uint32_t tmem, int warp) {
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
    __syncthreads();
    if (warp == 0) asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, 128;\n" ::"r"(tmem));
}

extern "C" __global__ void __launch_bounds__(128) tcgen05_st_ld(const uint32_t* __restrict__ in, uint32_t* __restrict__ out) {
    __shared__ uint32_t tmem_slot;
    const int warp = threadIdx.x / 32;
    const uint32_t tmem = alloc_columns(&tmem_slot, warp);
    const uint32_t addr = tmem + ((uint32_t)(32 * (warp % 4)) << 16);
    uint32_t v[4];
    for (int i = 0; i < 4; ++i) v[i] = in[threadIdx.x * 4 + i];
    asm volatile("tcgen05.st.sync.aligned.32x32b.x4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                 : "memory");
    asm volatile("tcgen05.wait::st.sync.aligned;\n" ::: "memory");
    uint32_t w[4];
    asm volatile("tcgen05.ld.sync.aligned.32x32b.x4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(addr));
    asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory");
    for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = w[i];
    free_columns(tmem, warp);
}

extern "C" __global__ void __launch_bounds__(128) tcgen05_scaled_mma(uint64_t scale_desc, uint64_t adesc, uint64_t bdesc,
                                                                     uint32_t idesc, uint32_t* __restrict__ done) {
    __shared__ uint32_t tmem_slot;
    __shared__ __align__(8) uint64_t bar;
    const int warp = threadIdx.x / 32;
    const uint32_t tmem = alloc_columns(&tmem_slot, warp);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&bar)));
        // columns 64..95: A's scales, 96..127: B's (each tcgen05.cp.128x256b fills 8 columns of 32 bits)
        for (int c = 0; c < 32; c += 8) {
            asm volatile("tcgen05.cp.cta_group::1.128x256b [%0], %1;\n" ::"r"(tmem + 64 + c), "l"(scale_desc) : "memory");
            asm volatile("tcgen05.cp.cta_group::1.128x256b [%0], %1;\n" ::"r"(tmem + 96 + c), "l"(scale_desc) : "memory");
        }
        asm volatile("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale [%0], %1, %2, %3, [%4], [%5], 0;\n"
                     ::"r"(tmem), "l"(adesc), "l"(bdesc), "r"(idesc), "r"(tmem + 64), "r"(tmem + 96) : "memory");
        asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(smem_addr(&bar))
                     : "memory");
    }
    __syncwarp();
    asm volatile("{\n .reg .pred p;\nWAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n @!p bra WAIT_%=;\n}\n"
                 ::"r"(smem_addr(&bar)) : "memory");
    if (threadIdx.x == 0) done[0] = 1u;
    free_columns(tmem, warp);
}
