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
// Only the first n elements of each block's row are read: a copy that straddles n passes the bytes
// below n as its src-size and the hardware zero-fills the rest of its 16 bytes (src-size 0 past n),
// which is how real kernels, Triton's included, mask a tail without a branch.
// Two variants beside it, for the chapter's comparisons:
//   staged_tile_sums:           the pre-Ampere way: ld.global into registers, st.shared from them
//                               (one tile held in registers while the previous one is summed);
//   cp_async_mbarrier_tile_sums: the same ring as cp_async_tile_sums, completed on one mbarrier per
//                               slot (cp.async.mbarrier.arrive.noinc) instead of commit/wait groups.
// PTX ISA: cp.async (src-size, .L2::128B), cp.async.commit_group, cp.async.wait_group,
// cp.async.mbarrier.arrive, mbarrier.init / test_wait.parity (sm_80 and later).
#include <cstdint>

#define THREADS 128
#define STAGES 3
#define TILE (4 * THREADS)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));     // shared-window address
}

// copy src_bytes (0..16) of the 16 at gmem_src, zero-fill the rest; .L2::128B: L2 may fetch the
// whole 128-byte line around it (a prefetch hint)
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes = 16) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"
                 ::"r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// bytes of the 16 at element `first` (4 floats) that lie below n: 16, 0, or 4/8/12 on the boundary
__device__ __forceinline__ int bytes_below(int first, int n) { return 4 * max(0, min(4, n - first)); }

extern "C" __global__ void __launch_bounds__(THREADS) cp_async_tile_sums(const float* __restrict__ x, float* __restrict__ out, int n_tiles,
                                                                       int n) {
    __shared__ __align__(16) float ring[STAGES][TILE];   // STAGES x 2 KiB
    __shared__ float warp_sums[THREADS / 32];
    const int tid = threadIdx.x;
    const float* base = x + (size_t)blockIdx.x * n_tiles * TILE;

    for (int j = 0; j < STAGES - 1; ++j) {               // prologue
        if (j < n_tiles)
            cp_async_16(&ring[j % STAGES][4 * tid], base + (size_t)j * TILE + 4 * tid, bytes_below(j * TILE + 4 * tid, n));
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
        if (j < n_tiles)
            cp_async_16(&ring[j % STAGES][4 * tid], base + (size_t)j * TILE + 4 * tid, bytes_below(j * TILE + 4 * tid, n));
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

// Register-staged: each thread loads its 16 bytes of tile i+1 into a float4 (ld.global, 4 registers)
// while the block sums tile i from shared memory, then stores them (st.shared). Two buffers.
extern "C" __global__ void __launch_bounds__(THREADS) staged_tile_sums(const float* __restrict__ x, float* __restrict__ out, int n_tiles) {
    __shared__ __align__(16) float buf[2][TILE];          // 2 x 2 KiB
    __shared__ float warp_sums[THREADS / 32];
    const int tid = threadIdx.x;
    const float4* base = reinterpret_cast<const float4*>(x + (size_t)blockIdx.x * n_tiles * TILE) + tid;
    float4 next = base[0];                                  // tile 0 -> registers
    for (int i = 0; i < n_tiles; ++i) {
        reinterpret_cast<float4*>(buf[i % 2])[tid] = next;  // registers -> shared
        __syncthreads();                                    // tile i staged; everyone done with tile i-2's buffer
        if (i + 1 < n_tiles) next = base[(size_t)(i + 1) * THREADS];   // tile i+1 -> registers, in flight
        const float* t = &buf[i % 2][4 * tid];
        float s = (t[0] + t[1]) + (t[2] + t[3]);
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if ((tid & 31) == 0) warp_sums[tid >> 5] = s;
        __syncthreads();
        if (tid == 0) {
            float total = 0.f;
            for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[w];
            out[(size_t)blockIdx.x * n_tiles + i] = total;
        }
    }
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// the barrier receives one arrival from this thread once all its earlier cp.async have landed;
// .noinc: that arrival is one of the `count` the barrier was initialised with
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// spin until the phase with this parity has completed (test_wait: sm_80; try_wait, which may
// suspend the thread, needs sm_90)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    asm volatile("{\n .reg .pred done;\nWAIT_%=:\n mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// The ring of cp_async_tile_sums completed on mbarriers: full[s] expects THREADS arrivals, one per
// thread, each made by the hardware when that thread's copies into slot s have landed. A wait on
// full[s] then means every thread's copies have landed (the group version needs wait_group and a
// __syncthreads for that), and no group count has to be kept regular.
extern "C" __global__ void __launch_bounds__(THREADS) cp_async_mbarrier_tile_sums(const float* __restrict__ x, float* __restrict__ out,
                                                                                int n_tiles) {
    __shared__ __align__(16) float ring[STAGES][TILE];
    __shared__ __align__(8) uint64_t full[STAGES];
    __shared__ float warp_sums[2][THREADS / 32];          // two buffers: no barrier before writing the next
    const int tid = threadIdx.x;
    const float* base = x + (size_t)blockIdx.x * n_tiles * TILE;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) mbar_init(&full[s], THREADS);
    }
    __syncthreads();                                         // the initialised barriers are visible to the block
    for (int j = 0; j < STAGES - 1 && j < n_tiles; ++j) {  // prologue
        cp_async_16(&ring[j][4 * tid], base + (size_t)j * TILE + 4 * tid);
        cp_async_arrive(&full[j]);
    }
    for (int i = 0; i < n_tiles; ++i) {
        const int s = i % STAGES;
        mbar_wait(&full[s], (i / STAGES) & 1);               // all THREADS copies of tile i have landed
        const float* t = &ring[s][4 * tid];
        float v = (t[0] + t[1]) + (t[2] + t[3]);
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if ((tid & 31) == 0) warp_sums[i & 1][tid >> 5] = v;
        __syncthreads();                                     // everyone done with tile i (and so with i-1)
        const int j = i + STAGES - 1;                        // refill the slot tile i-1 used
        if (j < n_tiles) {
            cp_async_16(&ring[j % STAGES][4 * tid], base + (size_t)j * TILE + 4 * tid);
            cp_async_arrive(&full[j % STAGES]);
        }
        if (tid == 0) {
            float total = 0.f;
            for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[i & 1][w];
            out[(size_t)blockIdx.x * n_tiles + i] = total;
        }
    }
}
