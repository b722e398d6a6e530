// cp.async: global -> shared copies that bypass the registers, overlapped with compute.
//
// out[b, i] = sum of tile i of block b, where x is (blocks, n_tiles, TILE) fp32 and TILE = 4 * THREADS:
// each of the THREADS threads copies 16 bytes (4 floats) of every tile with one cp.async.
// Shared memory is a ring of STAGES tile buffers. The loop is the one kernels/ptx/cp_async.py emulates
// (pipelined_tile_sums):
//   prologue: issue tiles 0 .. STAGES-2, one commit group each;
//   iteration i: wait_group(STAGES-2)  -> this thread's copies of tile i have landed,
//                __syncthreads()       -> every thread's have, and everyone is done with tile i-1,
//                sum tile i,
//                issue tile i+STAGES-1 into the slot tile i-1 used, commit (possibly empty group).
// PTX ISA: cp.async, cp.async.commit_group, cp.async.wait_group (sm_80 and later).
#define THREADS 128
#define STAGES 3
#define TILE (4 * THREADS)

__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));  // shared-window address
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

extern "C" __global__ void __launch_bounds__(THREADS) cp_async_tile_sums(const float* __restrict__ x, float* __restrict__ out, int n_tiles) {
    __shared__ __align__(16) float ring[STAGES][TILE];   // STAGES x 2 KiB
    __shared__ float warp_sums[THREADS / 32];
    const int tid = threadIdx.x;
    const float* base = x + (size_t)blockIdx.x * n_tiles * TILE;

    for (int j = 0; j < STAGES - 1; ++j) {               // prologue
        if (j < n_tiles) cp_async_16(&ring[j % STAGES][4 * tid], base + (size_t)j * TILE + 4 * tid);
        cp_async_commit();
    }
    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<STAGES - 2>();                     // at most STAGES-2 groups pending: tile i landed
        __syncthreads();
        const float* t = &ring[i % STAGES][4 * tid];
        float s = (t[0] + t[1]) + (t[2] + t[3]);         // this thread's 4 elements
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);  // warp sum
        if ((tid & 31) == 0) warp_sums[tid >> 5] = s;
        const int j = i + STAGES - 1;                    // refill the slot tile i-1 used
        if (j < n_tiles) cp_async_16(&ring[j % STAGES][4 * tid], base + (size_t)j * TILE + 4 * tid);
        cp_async_commit();
        __syncthreads();
        if (tid == 0) {
            float total = 0.f;
            for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[w];
            out[(size_t)blockIdx.x * n_tiles + i] = total;
        }
    }
    cp_async_wait<0>();
}
