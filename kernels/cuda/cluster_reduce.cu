// Thread block clusters and distributed shared memory (DSM): blocks of one cluster read each
// other's shared memory.
//
// __cluster_dims__(CLUSTER, 1, 1) groups every CLUSTER consecutive blocks into a cluster that is
// scheduled on one GPC at the same time (CUDA C++ Programming Guide, "Thread Block Clusters",
// "Distributed Shared Memory"). PTX ISA (nvidia2025ptx): %cluster_ctarank is a block's rank in its
// cluster; mapa.shared::cluster maps a shared-memory address of this block to the same variable
// in block `rank`; ld.shared::cluster reads it; barrier.cluster.arrive.release +
// barrier.cluster.wait.acquire is cluster.sync(), a barrier for all threads of all the blocks,
// which also makes their shared-memory writes visible across the cluster.
//
// cluster_sum: out[c] = sum of x[c * CLUSTER * n_per_block ... (c + 1) * CLUSTER * n_per_block).
// Each block sums its n_per_block elements into its own shared `partial`; after a cluster
// barrier, rank 0's first CLUSTER threads each read one block's `partial` through DSM and a
// shuffle adds them. A second cluster barrier keeps every block (and its shared memory) alive
// until rank 0 has read it. `skip` drops barrier 1 (bit 0) or barrier 2 (bit 1): the broken variants.
#define CLUSTER 4
#define THREADS 256

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS)
cluster_sum(const float* __restrict__ x, float* __restrict__ out, int n_per_block, int skip) {
    __shared__ float partial;
    __shared__ float warp_sums[THREADS / 32];
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    const float* mine = x + (size_t)blockIdx.x * n_per_block;
    float acc = 0.f;
    for (int i = threadIdx.x; i < n_per_block; i += THREADS) acc += mine[i];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int w = 0; w < THREADS / 32; ++w) s += warp_sums[w];
        partial = s;
    }
    if (!(skip & 1)) cluster_sync();                                   // barrier 1: every partial written
    if (rank == 0 && threadIdx.x < 32) {
        float v = 0.f;
        if (threadIdx.x < CLUSTER) {
            unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(&partial)), remote;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(threadIdx.x));
            asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
        }
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (threadIdx.x == 0) out[blockIdx.x / CLUSTER] = v;
    }
    if (!(skip & 2)) cluster_sync();                                   // barrier 2: no block exits before rank 0 read it
}
