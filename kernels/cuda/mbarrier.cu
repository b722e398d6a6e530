// mbarrier: a barrier object in shared memory that waits for arrivals AND for bytes.
//
// PTX ISA (nvidia2025ptx), "Parallel Synchronization and Communication Instructions: mbarrier":
// an mbarrier holds a phase (its parity is what waits test), a pending-arrival count reset to the
// expected count at every phase change, and a transaction count (tx-count) of bytes still owed by
// asynchronous copies. The current phase completes when both counts reach zero; then the phase
// flips. try_wait.parity P returns true once the phase with parity P has completed, i.e. while the
// current phase's parity is not P. kernels/ptx/mbarrier.py emulates exactly this state machine.
//
// Kernel mbarrier_ring_sums: out[i] = sum of tile i of x (n_tiles x TILE fp32), one block.
// Warp 0 is the producer, warps 1..CONSUMERS are consumers. Shared memory is a ring of STAGES
// tiles with two mbarriers per slot:
//   full[s]  (expected arrivals 1): one producer thread arrives with expect_tx(TILE*4) and starts a
//            cp.async.bulk of the tile whose completion pays the bytes back (complete_tx);
//   empty[s] (expected arrivals CONSUMERS): one thread per consumer warp arrives when done reading.
// Round r = i / STAGES of slot s waits full[s] on parity (r & 1); the producer waits empty[s] on
// parity ((r & 1) ^ 1), which passes at once in round 0 (the phase "before" phase 0 counts as done).
#include <cstdint>

#define STAGES 3
#define TILE 1024                 // floats per tile: 4 KiB, a multiple of 16 bytes as cp.async.bulk needs
#define CONSUMERS 2               // consumer warps
#define THREADS (32 * (1 + CONSUMERS))

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
}

// arrive (pending arrivals - 1) and raise the tx-count by `bytes` in one step
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n"
                 ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// spin until the phase with this parity has completed
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\n"
        "WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// bulk copy global -> shared; its bytes are counted off the barrier's tx-count when they land
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS) mbarrier_ring_sums(const float* __restrict__ x, float* __restrict__ out,
                                                                        int n_tiles, int wrong_parity) {
    __shared__ __align__(128) float ring[STAGES][TILE];     // STAGES x 4 KiB
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int j = threadIdx.x; j < STAGES * TILE; j += THREADS) (&ring[0][0])[j] = __int_as_float(0x7fc00000);  // NaN: a read before the bytes land shows
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CONSUMERS); }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // inits visible to the async proxy
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the NaN stores before the copy engine's writes
    __syncthreads();
    if (warp == 0) {                                                  // producer
        if (lane == 0) {
            for (int i = 0; i < n_tiles; ++i) {
                const int s = i % STAGES;
                const unsigned round = i / STAGES;
                mbar_wait(&empty[s], (round & 1) ^ 1);                // slot free (round 0: passes at once)
                mbar_arrive_expect_tx(&full[s], TILE * sizeof(float));
                bulk_copy(ring[s], x + (size_t)i * TILE, TILE * sizeof(float), &full[s]);
            }
        }
    } else {                                                          // consumers: warp c takes tiles c-1, c-1+CONSUMERS, ...
        for (int i = 0; i < n_tiles; ++i) {
            const int s = i % STAGES;
            const unsigned round = i / STAGES;
            mbar_wait(&full[s], (round & 1) ^ (unsigned)wrong_parity);  // bytes of tile i have landed
            if ((i % CONSUMERS) == warp - 1) {
                float acc = 0.f;
                for (int j = lane; j < TILE; j += 32) acc += ring[s][j];
                for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
                if (lane == 0) out[i] = acc;
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[s]);                    // every consumer warp releases every slot
        }
    }
}
