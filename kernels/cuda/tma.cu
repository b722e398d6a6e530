// TMA: one thread copies a whole tile, described by a tensor map, into shared memory.
//
// cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [tmap, {x, y}], [bar]
// (PTX ISA, "Data Movement and Conversion Instructions: cp.async.bulk.tensor"): the tensor map (a
// 128-byte object made on the host by cuTensorMapEncodeTiled, passed as a __grid_constant__ kernel
// parameter) holds the global address, sizes, strides, the box (tile) size, the swizzle and the
// out-of-bounds fill. {x, y} are the box's starting coordinates, innermost first; elements outside
// the tensor are filled (zeros, or NaN) instead of read. The copied bytes are counted off the
// mbarrier's tx-count (kernels/ptx/mbarrier.py); kernels/ptx/tma.py emulates the copy and its
// shared-memory layout.
#include <cstdint>

struct alignas(64) TensorMap { uint64_t opaque[16]; };   // CUtensorMap: 128 opaque bytes

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\nWAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* tmap, int x, int y, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(tmap)), "r"(x), "r"(y), "r"(smem_addr(bar)) : "memory");
}

// Multicast: the same box lands in the shared memory (same offset) of every CTA in cta_mask, and
// each of those CTAs' mbarriers (same offset) is paid the bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const TensorMap* tmap, int x, int y, uint64_t* bar,
                                                      uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;\n"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(tmap)), "r"(x), "r"(y), "r"(smem_addr(bar)), "h"(cta_mask)
        : "memory");
}

// One box at (x, y): thread 0 arms the barrier with the box's bytes and issues the copy; every
// thread waits for phase 0, then the block copies the raw shared-memory bytes (swizzle and fill
// included) to out, so the host can compare them with the emulation. box_bytes <= 16384.
extern "C" __global__ void __launch_bounds__(128) tma_load_box(const __grid_constant__ TensorMap tmap, uint4* out,
                                                                int x, int y, int box_bytes) {
    __shared__ __align__(1024) uint4 smem[1024];
    __shared__ __align__(8) uint64_t bar;
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_expect_tx(&bar, box_bytes);
        tma_load_2d(smem, &tmap, x, y, &bar);
    }
    mbar_wait(&bar, 0);
    for (int i = threadIdx.x; i < box_bytes / 16; i += blockDim.x) out[i] = smem[i];
}

// A cluster of 2 CTAs: CTA 0 issues one multicast load for both; each CTA waits on its own barrier
// and writes its copy to out[rank].
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(128)
tma_multicast_box(const __grid_constant__ TensorMap tmap, uint4* out, int x, int y, int box_bytes) {
    __shared__ __align__(1024) uint4 smem[1024];
    __shared__ __align__(8) uint64_t bar;
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        mbar_expect_tx(&bar, box_bytes);          // each CTA expects the bytes that will land in it
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    if (rank == 0 && threadIdx.x == 0) tma_load_2d_multicast(smem, &tmap, x, y, &bar, 0x3);
    mbar_wait(&bar, 0);
    for (int i = threadIdx.x; i < box_bytes / 16; i += blockDim.x) out[(size_t)rank * (box_bytes / 16) + i] = smem[i];
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
