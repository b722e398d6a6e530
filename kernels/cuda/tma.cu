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

// TMA store, shared -> global (PTX ISA "cp.async.bulk.tensor", direction .global.shared::cta): the
// box's image in shared memory (swizzled as the map says) is written back at (x, y); elements that
// fall outside the tensor are not written. The writes by threads are generic-proxy stores and TMA
// reads through the async proxy, so fence.proxy.async.shared::cta must order them (then a block
// barrier). Completion is tracked by a bulk async-group, not an mbarrier: commit_group closes the
// group and wait_group.read 0 waits until the source has been read (shared memory reusable);
// wait_group 0 without .read would also wait for the global writes to be done.
__device__ __forceinline__ void tma_store_2d(const TensorMap* tmap, int x, int y, const void* src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"(reinterpret_cast<uint64_t>(tmap)), "r"(x), "r"(y), "r"(smem_addr(src)) : "memory");
}

// prefetch.tensormap: bring the 128-byte tensor map into the cache that TMA reads it from, before
// the first copy needs it (CUTLASS issues it once per tensor map at kernel start).
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* tmap) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// The inverse of tma_load_box: the block copies box_bytes of raw shared-memory image from in
// (swizzle included, as T.smem_image makes it) and thread 0 stores the box at (x, y).
extern "C" __global__ void __launch_bounds__(128) tma_store_box(const __grid_constant__ TensorMap tmap,
                                                                 const uint4* in, int x, int y, int box_bytes) {
    __shared__ __align__(1024) uint4 smem[1024];
    if (threadIdx.x == 0) tma_prefetch_map(&tmap);
    for (int i = threadIdx.x; i < box_bytes / 16; i += blockDim.x) smem[i] = in[i];
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // generic writes -> async-proxy reads
    __syncthreads();
    if (threadIdx.x == 0) {
        tma_store_2d(&tmap, x, y, smem);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
}

// 1-D bulk copies (PTX ISA "cp.async.bulk"): no tensor map, just a source, a destination and a byte
// count (a multiple of 16, both addresses 16-byte aligned). Global -> shared completes on an
// mbarrier like a TMA load; shared -> global on a bulk async-group like a TMA store. DeepEP moves
// its token payloads this way (tma_load_1d / tma_store_1d in csrc/kernels/utils.cuh at 2a67a8d).
// The load names its destination .shared::cta (PTX 8.6), not .shared::cluster as tma_load_2d does:
// on sm120 the .shared::cluster form compiles to a test of the destination's CTA and a call.
extern "C" __global__ void __launch_bounds__(128) bulk_copy_1d(const uint4* src, uint4* dst, int bytes) {
    __shared__ __align__(128) uint4 smem[1024];
    __shared__ __align__(8) uint64_t bar;
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        mbar_expect_tx(&bar, bytes);
        asm volatile("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     ::"r"(smem_addr(smem)), "l"(src), "r"(bytes), "r"(smem_addr(&bar)) : "memory");
    }
    mbar_wait(&bar, 0);          // the bytes have landed; no thread touched them
    if (threadIdx.x == 0) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                     ::"l"(dst), "r"(smem_addr(smem)), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");   // writes done before the kernel ends
    }
}
