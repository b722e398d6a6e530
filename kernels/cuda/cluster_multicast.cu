// What production kernels do with a cluster: one block's copy lands in every block (TMA multicast),
// consumers release the producer's buffer with an arrive on ITS mbarrier (a remote arrive), and
// blocks push results into a peer's shared memory with one-way stores that complete on the peer's
// mbarrier (st.async, red.async) instead of meeting at a cluster barrier.
//
// PTX ISA (nvidia2025ptx): cp.async.bulk ... .multicast::cluster writes the same bytes at the same
// shared-memory offset of every block in ctaMask and performs complete_tx on the mbarrier at the
// same offset in each of them; mapa maps an address of this block to the same variable in block
// `rank`; mbarrier.arrive.release.cluster.shared::cluster arrives on a peer's mbarrier;
// st.async / red.async store / reduce into a peer's shared memory and perform complete_tx (the
// bytes written) on the peer's mbarrier. sm_90 and later.
#include <cstdint>

#define CLUSTER 2
#define THREADS 128
#define STAGES 2
#define TILE 1024                          // floats: 4 KiB per tile

__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

// the same shared variable in block `rank` of the cluster (a shared::cluster address)
__device__ __forceinline__ unsigned peer_addr(const void* p, unsigned rank) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
    return remote;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n"
                 ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    asm volatile("{\n .reg .pred done;\nWAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// arrive on the mbarrier at `bar`'s offset in block `rank` (release: this block's reads of the
// slot happen before the producer may overwrite it)
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* bar, unsigned rank) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(peer_addr(bar, rank)) : "memory");
}

// one bulk copy into every block of `mask`, at dst's offset, completing on each block's `bar`
__device__ __forceinline__ void bulk_copy_multicast(void* dst, const void* src, unsigned bytes, uint64_t* bar,
                                                    uint16_t mask) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1], %2, [%3], %4;\n"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "h"(mask) : "memory");
}

// cluster_multicast_sums: out[b, i] = scale[b] * sum(x[i]): every block of a cluster needs every
// tile of x (as the blocks along N of a GEMM need the same A tile). Rank 0's thread 0 loads each
// tile ONCE and multicasts it into all CLUSTER blocks' ring slot; each block's full[s] counts the
// bytes; each block, done with slot s, arrives on rank 0's empty[s] (CLUSTER arrivals expected),
// and rank 0 waits for that before it multicasts the next tile into the slot.
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS)
cluster_multicast_sums(const float* __restrict__ x, const float* __restrict__ scale, float* __restrict__ out, int n_tiles) {
    __shared__ __align__(128) float ring[STAGES][TILE];
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    __shared__ float warp_sums[2][THREADS / 32];
    const unsigned rank = cluster_rank();
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CLUSTER); }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();                                          // every block's barriers exist before any copy lands
    for (int i = 0; i < n_tiles; ++i) {
        const int s = i % STAGES;
        const unsigned phase = (i / STAGES) & 1;
        if (tid == 0) {
            mbar_expect_tx(&full[s], TILE * sizeof(float));  // my slot s will receive one tile
            if (rank == 0) {
                mbar_wait(&empty[s], phase ^ 1);             // every block released slot s (round 0: at once)
                bulk_copy_multicast(ring[s], x + (size_t)i * TILE, TILE * sizeof(float), &full[s], (1u << CLUSTER) - 1);
            }
        }
        mbar_wait(&full[s], phase);                          // tile i has landed in MY slot s
        float v = 0.f;
        for (int j = tid; j < TILE; j += THREADS) v += ring[s][j];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (tid % 32 == 0) warp_sums[i & 1][tid / 32] = v;
        __syncthreads();                                     // the whole block is done reading slot s
        if (tid == 0) {
            mbar_arrive_remote(&empty[s], 0);                // release slot s to the producer in rank 0
            float total = 0.f;
            for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[i & 1][w];
            out[(size_t)blockIdx.x * n_tiles + i] = scale[blockIdx.x] * total;
        }
    }
    cluster_sync();                                          // no block exits while a peer may still signal it
}

// cluster_sum_push: out[c] = sum and count[c] = number of positive elements of cluster c's
// CLUSTER * n_per_block elements. Each block pushes its partial sum into rank 0's slot[rank]
// with st.async and adds its positive count into rank 0's counter with red.async; both complete
// on rank 0's mbarrier, which expects 8 bytes per block. Rank 0 waits on its own barrier: no
// second cluster barrier, and the senders need not wait for rank 0 to read.
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS)
cluster_sum_push(const float* __restrict__ x, float* __restrict__ out, unsigned* __restrict__ count, int n_per_block) {
    __shared__ float slot[CLUSTER];
    __shared__ unsigned positives;
    __shared__ __align__(8) uint64_t arrived;
    __shared__ float warp_sums[THREADS / 32];
    __shared__ unsigned warp_counts[THREADS / 32];
    const unsigned rank = cluster_rank();
    const int tid = threadIdx.x;
    if (tid == 0) {
        positives = 0;
        mbar_init(&arrived, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();                                          // rank 0's barrier and counter exist before any push
    const float* mine = x + (size_t)blockIdx.x * n_per_block;
    float acc = 0.f;
    unsigned pos = 0;
    for (int i = tid; i < n_per_block; i += THREADS) { acc += mine[i]; pos += mine[i] > 0.f; }
    for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
        pos += __shfl_xor_sync(0xffffffffu, pos, off);
    }
    if (tid % 32 == 0) { warp_sums[tid / 32] = acc; warp_counts[tid / 32] = pos; }
    __syncthreads();
    if (tid == 0) {
        float s = 0.f;
        unsigned p = 0;
        for (int w = 0; w < THREADS / 32; ++w) { s += warp_sums[w]; p += warp_counts[w]; }
        const unsigned bar = peer_addr(&arrived, 0);
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n"
                     ::"r"(peer_addr(&slot[rank], 0)), "f"(s), "r"(bar) : "memory");
        asm volatile("red.async.relaxed.cluster.shared::cluster.mbarrier::complete_tx::bytes.add.u32 [%0], %1, [%2];\n"
                     ::"r"(peer_addr(&positives, 0)), "r"(p), "r"(bar) : "memory");
        if (rank == 0) {
            mbar_expect_tx(&arrived, CLUSTER * 8);           // CLUSTER floats and CLUSTER u32 additions
            mbar_wait(&arrived, 0);
            float total = 0.f;
            for (int r = 0; r < CLUSTER; ++r) total += slot[r];
            out[blockIdx.x / CLUSTER] = total;
            count[blockIdx.x / CLUSTER] = positives;
        }
    }
}
