// wgmma: a warpgroup (4 warps, 128 threads) multiplies matrices it reads from shared memory.
//
// wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 (PTX ISA, "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate Instructions"): D (64x64 f32, in registers) += A (64x16 f16) * B (16x64 f16),
// A and B both read from shared memory through 64-bit matrix descriptors. Both are K-major here:
// A is M x K row-major, B is stored as B^T, N x K row-major. Descriptor bits (PTX ISA "Matrix
// Descriptor Format"; CuTe's GmmaDescriptor): [0,14) start address >> 4, [16,30) leading byte
// offset >> 4, [32,46) stride byte offset >> 4, [49,52) base offset, [62,64) swizzle mode
// (0 none, 1 128B, 2 64B, 3 32B). kernels/ptx/wgmma.py encodes, decodes and emulates them.
// Accumulator layout: thread t = 32w + 4g + q holds d[i] = D[16w + g + 8((i/2)%2)][8(i/4) + 2q + (i%2)].
#include <cstdint>
#include <cuda_fp16.h>

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint64_t make_desc(unsigned addr, unsigned lbo, unsigned sbo, unsigned mode) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16)
         | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | ((uint64_t)(mode & 3) << 62);
}

// d += A B over one k16 step; accumulate = 0 makes it d = A B
__device__ __forceinline__ void wgmma_m64n64k16(float d[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// generic-proxy stores to shared memory, made visible to the async proxy that wgmma reads through
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// One instruction on a shared-memory image chosen by the host: image (bytes, copied to a 1024-byte
// aligned buffer at offset 0), desc_a / desc_b with start addresses relative to that buffer.
// d_out: 128 threads x 32 accumulator registers. Checks the descriptor and the fragment layout.
extern "C" __global__ void __launch_bounds__(128) wgmma_image(const uint4* image, int image_16b, uint64_t desc_a,
                                                               uint64_t desc_b, float* d_out) {
    __shared__ __align__(1024) uint4 smem[1024];          // 16 KiB
    for (int i = threadIdx.x; i < image_16b && i < 1024; i += 128) smem[i] = image[i];
    fence_async_shared();
    __syncthreads();
    const uint64_t base = (uint64_t)(smem_addr(smem) >> 4);   // added to the 14-bit start field
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    wgmma_fence();
    wgmma_m64n64k16(d, desc_a + base, desc_b + base, 0);
    wgmma_commit();
    wgmma_wait_all();
    for (int i = 0; i < 32; ++i) d_out[threadIdx.x * 32 + i] = d[i];
}

// D (64x64 f32, row-major) = A (64x64 f16, row-major) B (64x64 f16, given as B^T row-major).
// Both tiles are stored K-major with the 128-byte swizzle (CuTe's Layout_K_SW128_Atom): element
// (r, k) at byte r*128 + 2k with bits [4,7) XOR-ed by bits [7,10). One descriptor per tile; step
// kk of the 4 k16 steps starts 32 bytes further (16 f16 along K inside the swizzled row).
// mode != 1 builds the descriptors with that swizzle code instead (a deliberately wrong variant).
extern "C" __global__ void __launch_bounds__(128) wgmma_gemm_sw128(const __half* A, const __half* Bt, float* D, int mode) {
    __shared__ __align__(1024) __half As[64 * 64];        // 8 KiB each
    __shared__ __align__(1024) __half Bs[64 * 64];
    for (int i = threadIdx.x; i < 64 * 8; i += 128) {     // one 16-byte chunk per step
        const int r = i / 8, c = i % 8;                   // row r, chunk c (8 f16)
        const int dst = r * 8 + (c ^ (r % 8));            // swizzled chunk index: byte bits [4,7) ^= [7,10)
        reinterpret_cast<uint4*>(As)[dst] = reinterpret_cast<const uint4*>(A)[i];
        reinterpret_cast<uint4*>(Bs)[dst] = reinterpret_cast<const uint4*>(Bt)[i];
    }
    fence_async_shared();
    __syncthreads();
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    wgmma_fence();
    for (int kk = 0; kk < 4; ++kk) {                      // SBO = 8 rows x 128 B = 1024; LBO unused (16)
        const uint64_t da = make_desc(smem_addr(As) + 32 * kk, 16, 1024, mode);
        const uint64_t db = make_desc(smem_addr(Bs) + 32 * kk, 16, 1024, mode);
        wgmma_m64n64k16(d, da, db, 1);
    }
    wgmma_commit();
    wgmma_wait_all();
    const int t = threadIdx.x, w = t / 32, g = (t % 32) / 4, q = t % 4;
    for (int i = 0; i < 32; ++i)
        D[(16 * w + g + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * q + (i % 2)] = d[i];
}
