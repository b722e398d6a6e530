// TMA reductions and L2 cache hints (PTX ISA, "cp.reduce.async.bulk.tensor" and "createpolicy"; sm_90).
//
// cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group: the inverse direction of a TMA
// load, like a TMA store, but each element of the box is ADDED to the global tensor (atomically per
// element) instead of overwriting it. Split-K and stream-K GEMMs and gradient accumulation write partial
// tiles this way without a separate reduction kernel. Completion is a bulk async-group, as for the store.
// .L2::cache_hint takes a 64-bit policy made by createpolicy: here evict_first, for a result that will not
// be read again soon (the opposite, evict_last, keeps a tile that later CTAs reread).
//
// Kernel tma_reduce_add_box: the block copies box_bytes of raw shared-memory image from in, then thread 0
// reduce-adds the box into the tensor at (x, y). On a GPU, running it twice doubles the box's elements.
#include <cstdint>

struct alignas(64) TensorMap { uint64_t opaque[16]; };   // CUtensorMap: 128 opaque bytes

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

extern "C" __global__ void __launch_bounds__(128) tma_reduce_add_box(const __grid_constant__ TensorMap tmap,
                                                                      const uint4* in, int x, int y, int box_bytes) {
    __shared__ __align__(1024) uint4 smem[1024];
    for (int i = threadIdx.x; i < box_bytes / 16; i += blockDim.x) smem[i] = in[i];
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // generic writes -> async-proxy reads
    __syncthreads();
    if (threadIdx.x == 0) {
        uint64_t policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
        asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group.L2::cache_hint"
                     " [%0, {%1, %2}], [%3], %4;\n"
                     ::"l"(reinterpret_cast<uint64_t>(&tmap)), "r"(x), "r"(y), "r"(smem_addr(smem)), "l"(policy) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
}
