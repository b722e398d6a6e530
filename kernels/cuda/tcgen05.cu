// tcgen05 and tensor memory (TMEM): Blackwell's single-thread MMA with the accumulator outside the registers.
//
// PTX ISA (nvidia2025ptx), "TensorCore 5th Generation Family Instructions": each SM has 256 KiB of
// tensor memory, 128 lanes x 512 columns of 32-bit cells, addressed as (lane << 16) | column.
//   tcgen05.alloc      a warp allocates N columns (a power of two, 32..512); the address lands in shared memory
//   tcgen05.mma        ONE thread issues D (TMEM) (+)= A (smem descriptor) x B (smem descriptor), shape from the
//                      32-bit instruction descriptor; kind::f16 with f32 accumulation here, M = 128, N = 64, K = 16
//   tcgen05.commit     the MMAs issued so far arrive on an mbarrier when they complete
//   tcgen05.ld         warp w reads lanes 32(w % 4) .. 32(w % 4) + 31: thread t gets lane 32(w % 4) + t,
//                      consecutive columns in consecutive registers (shape 32x32b)
//   tcgen05.dealloc    returns the columns
// For M = 128 (cta_group::1), row i of D lives in lane i and column j in column base + j.
// Kernels: tcgen05_gemm (operands as 8x8 core matrices, no swizzle) and tcgen05_gemm_sw128 / _sw64 / _sw32
// (operands in the 128-, 64- and 32-byte swizzled layouts, the descriptor's layout field set to match).
// kernels/ptx/tcgen05.py encodes the descriptors, emulates TMEM and checks the layout.
#include <cstdint>
#include <cuda_fp16.h>

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// sm100 shared-memory descriptor: sm90's fields plus version 1 at bits [46,48), 3-bit layout at [61,64)
// (0 none, 2 128B, 4 64B, 6 32B: kernels/ptx/tcgen05.py LAYOUT_CODE)
__device__ __forceinline__ uint64_t make_smem_desc(unsigned addr, unsigned lbo, unsigned sbo, unsigned layout = 0) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16)
         | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 46) | ((uint64_t)(layout & 7) << 61);
}

// Warp 0 allocates 64 TMEM columns, thread 0 initialises the commit barrier; generic smem stores are made
// visible to the tensor core. Returns the TMEM base address every thread reads after the barrier.
__device__ __forceinline__ uint32_t setup_tmem64(uint32_t* tmem_slot, uint64_t* bar, int warp) {
    if (warp == 0) {                                                   // a whole warp allocates 64 columns
        asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], 64;\n" ::"r"(smem_addr(tmem_slot)));
        asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n");
    }
    if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");     // generic stores -> visible to the tensor core
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
    __syncthreads();
    asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
    return *tmem_slot;
}

// One thread: D (TMEM) (+)= A B for one k16 step (accumulate = 0 overwrites).
__device__ __forceinline__ void mma_f16(uint32_t tmem, uint64_t da, uint64_t db, uint32_t idesc, int accumulate) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n"
                 " tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n}\n"
                 ::"r"(tmem), "l"(da), "l"(db), "r"(idesc), "r"(accumulate) : "memory");
}

// Thread 0 commits the issued MMAs to bar; every thread waits, reads its row of the 128 x 64 f32
// accumulator with tcgen05.ld 32x32b (warp w: lanes 32(w % 4)..+31) into D (row-major), and warp 0 frees the columns.
__device__ __forceinline__ void drain_tmem64(uint32_t tmem, uint64_t* bar, float* D, int warp, int lane) {
    if (threadIdx.x == 0)
        asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n"
                     ::"r"(smem_addr(bar)) : "memory");
    asm volatile("{\n .reg .pred done;\nWAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n"
                 " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)) : "memory");
    asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory");
    const int row = 32 * (warp % 4) + lane;                            // this thread's TMEM lane = row of D
    for (int c = 0; c < 64; c += 16) {
        uint32_t v[16];
        asm volatile("tcgen05.ld.sync.aligned.32x32b.x16.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, [%16];\n"
                     : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]), "=r"(v[4]), "=r"(v[5]), "=r"(v[6]), "=r"(v[7]), "=r"(v[8]), "=r"(v[9]), "=r"(v[10]), "=r"(v[11]), "=r"(v[12]), "=r"(v[13]), "=r"(v[14]), "=r"(v[15]) : "r"(tmem + ((uint32_t)(32 * (warp % 4)) << 16) + c));
        asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory");
        for (int j = 0; j < 16; ++j) D[row * 64 + c + j] = __uint_as_float(v[j]);
    }
    asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
    __syncthreads();
    if (warp == 0) asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, 64;\n" ::"r"(tmem));
}

// D (128 x 64 f32) = A (128 x K f16, row-major) B (K x 64, given as B^T: 64 x K row-major), K a multiple of 16 up to 64.
// A and B^T are stored K-major without swizzle: 8x8 core matrices of 128 bytes, K-blocks outermost
// (LBO = rows * 16 bytes between K-blocks, SBO = 128 bytes between 8-row groups).
// idesc: the instruction descriptor from the host (kernels/ptx/tcgen05.py encodes it; a wrong one is the broken variant).
extern "C" __global__ void __launch_bounds__(128) tcgen05_gemm(const __half* A, const __half* Bt, float* D, int K, uint32_t idesc) {
    __shared__ __align__(1024) __half As[128 * 64];
    __shared__ __align__(1024) __half Bs[64 * 64];
    __shared__ __align__(8) uint64_t bar;
    __shared__ uint32_t tmem_base;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = threadIdx.x; i < 128 * K / 8; i += 128) {          // one 16-byte row of a core matrix per step
        const int r = i / (K / 8), kb = i % (K / 8);
        reinterpret_cast<uint4*>(As)[kb * 128 + r] = reinterpret_cast<const uint4*>(A)[i];   // (kb, r/8, r%8) -> kb*128 + r
        if (r < 64) reinterpret_cast<uint4*>(Bs)[kb * 64 + r] = reinterpret_cast<const uint4*>(Bt)[i];
    }
    const uint32_t tmem = setup_tmem64(&tmem_base, &bar, warp);
    if (threadIdx.x == 0)                                              // one thread issues every MMA
        for (int k = 0; k < K / 16; ++k) {
            const uint64_t da = make_smem_desc(smem_addr(As) + k * 2 * 128 * 16, 128 * 16, 128);  // K-block pair k
            const uint64_t db = make_smem_desc(smem_addr(Bs) + k * 2 * 64 * 16, 64 * 16, 128);
            mma_f16(tmem, da, db, idesc, k);
        }
    drain_tmem64(tmem, &bar, D, warp, lane);
}

// The same product with SWIZZLED operands: A (128 x W/2 f16) and B^T (64 x W/2) K-major, each 8-row group one
// W-byte swizzle atom (CuTe's Layout_K_SW<W>_Atom), so K = W/2 and there are W/32 k16 steps. The host writes the
// shared-memory image with kernels/ptx/wgmma.py write_kmajor (as a TMA copy with the matching swizzle would):
// A at byte 0, B^T at byte 16384; the kernel copies it verbatim to 1024-byte aligned shared memory.
// Descriptors: LBO unused (16), SBO = 8 rows x W bytes, layout code LAYOUT; step k starts 32 bytes further
// (16 f16 along K inside the swizzled row; the hardware applies the XOR to the address it forms).
template <int W, unsigned LAYOUT>
__device__ __forceinline__ void gemm_swizzled(const uint4* image, float* D, uint32_t idesc) {
    __shared__ __align__(1024) uint4 smem[(16384 + 64 * 128) / 16];   // 24 KiB (tcgen05.py SW_SMEM_BYTES)
    __shared__ __align__(8) uint64_t bar;
    __shared__ uint32_t tmem_base;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int i = threadIdx.x; i < (16384 + 64 * W) / 16; i += 128) smem[i] = image[i];
    const uint32_t tmem = setup_tmem64(&tmem_base, &bar, warp);
    if (threadIdx.x == 0)
        for (int k = 0; k < W / 32; ++k)
            mma_f16(tmem, make_smem_desc(smem_addr(smem) + 32 * k, 16, 8 * W, LAYOUT),
                    make_smem_desc(smem_addr(smem) + 16384 + 32 * k, 16, 8 * W, LAYOUT), idesc, k);
    drain_tmem64(tmem, &bar, D, warp, lane);
}

extern "C" __global__ void __launch_bounds__(128) tcgen05_gemm_sw128(const uint4* image, float* D, uint32_t idesc) {
    gemm_swizzled<128, 2>(image, D, idesc);
}
extern "C" __global__ void __launch_bounds__(128) tcgen05_gemm_sw64(const uint4* image, float* D, uint32_t idesc) {
    gemm_swizzled<64, 4>(image, D, idesc);
}
extern "C" __global__ void __launch_bounds__(128) tcgen05_gemm_sw32(const uint4* image, float* D, uint32_t idesc) {
    gemm_swizzled<32, 6>(image, D, idesc);
}
