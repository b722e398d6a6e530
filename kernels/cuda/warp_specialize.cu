// Warp specialization: one warpgroup only copies, two warpgroups only compute, and registers move
// from the first to the others with setmaxnreg.
//
// 384 threads = 3 warpgroups. __launch_bounds__(384, 1) lets ptxas give every thread up to 168
// registers at launch (65536 / 384 rounded down to a multiple of 8: 384 x 168 = 64512).
// Warpgroup 0, the producer, gives registers back (setmaxnreg.dec 40); warpgroups 1 and 2, the
// consumers, take them (setmaxnreg.inc 232): 128 x 40 + 256 x 232 = 64512, the same pool
// (PTX ISA, "setmaxnreg": counts from 24 to 256 in multiples of 8, per warpgroup).
// The pipeline is the mbarrier ring of mbarrier.cu: the producer's lane 0 arms full[s] with the
// tile's bytes and starts a bulk copy; consumer warpgroup c sums tiles i with i % 2 == c - 1 and
// both consumer warpgroups release every slot on empty[s] (expected arrivals: 2, one per warpgroup).
// out[i] = sum of tile i of x (n_tiles x TILE fp32).
#include <cstdint>

#define STAGES 4
#define TILE 2048                  // floats: 8 KiB per slot
#define THREADS 384

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\nWAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) ws_ring_sums(const float* __restrict__ x, float* __restrict__ out,
                                                                      int n_tiles) {
    __shared__ __align__(128) float ring[STAGES][TILE];       // 32 KiB
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    __shared__ float partial[2][4];
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 2); }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {                                                // producer: few registers, one busy thread
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (t == 0) {
            for (int i = 0; i < n_tiles; ++i) {
                const int s = i % STAGES;
                mbar_wait(&empty[s], ((i / STAGES) & 1) ^ 1);
                mbar_arrive_expect_tx(&full[s], TILE * sizeof(float));
                bulk_copy(ring[s], x + (size_t)i * TILE, TILE * sizeof(float), &full[s]);
            }
        }
    } else {                                                      // consumers: the registers go here
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        for (int i = 0; i < n_tiles; ++i) {
            const int s = i % STAGES;
            mbar_wait(&full[s], (i / STAGES) & 1);
            if (i % 2 == wg - 1) {
                float acc = 0.f;
                for (int j = t; j < TILE; j += 128) acc += ring[s][j];
                for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
                if (t % 32 == 0) partial[wg - 1][t / 32] = acc;
                asm volatile("bar.sync %0, 128;\n" ::"r"(wg) : "memory");      // named barrier per warpgroup
                if (t == 0) out[i] = (partial[wg - 1][0] + partial[wg - 1][1]) + (partial[wg - 1][2] + partial[wg - 1][3]);
            }
            asm volatile("bar.sync %0, 128;\n" ::"r"(wg) : "memory");          // the warpgroup is done reading slot s
            if (t == 0) mbar_arrive(&empty[s]);
        }
    }
}
