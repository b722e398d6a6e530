// cp.async.mbarrier.arrive: Ampere's bridge from per-thread cp.async copies to an mbarrier.
//
// A cp.async group (commit_group / wait_group) belongs to the thread that committed it: only that
// thread can wait for it. cp.async.mbarrier.arrive (PTX ISA, "cp.async.mbarrier.arrive", sm_80)
// instead makes the mbarrier track all of the executing thread's prior cp.async copies and arrive
// on it when they have all landed. With .noinc that asynchronous arrival is the thread's arrival
// (the barrier is initialised with one expected arrival per copying thread); without .noinc the
// pending count is first raised by one, so the asynchronous arrival nets to zero and the thread
// must also arrive itself. kernels/ptx/cp_async.py emulates both forms (AsyncCopyUnit.mbarrier_arrive).
//
// Kernel cp_async_arrive_sum: out[0] = sum of x[0:TILE] (fp32), one block of 160 threads.
// Warps 0..3 (128 threads) each copy 16 bytes of the 2 KiB tile with cp.async and arrive on `full`
// through cp.async.mbarrier.arrive.noinc; they never wait. Warp 4 waits on `full` and sums the
// tile: it learns that 128 other threads' copies have landed without any block-wide barrier.
#include <cstdint>

#define TILE 512                  // floats: 128 threads x 16 bytes
#define COPIERS 128

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

extern "C" __global__ void __launch_bounds__(COPIERS + 32) cp_async_arrive_sum(const float4* __restrict__ x,
                                                                             float* __restrict__ out) {
    __shared__ __align__(16) float4 tile[TILE / 4];
    __shared__ __align__(8) uint64_t full;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(&full)), "r"(COPIERS) : "memory");
    __syncthreads();                                   // the init is visible before anyone arrives
    if (warp < COPIERS / 32) {                         // copiers: issue, hand completion to the barrier, leave
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                     ::"r"(smem_addr(&tile[threadIdx.x])), "l"(x + threadIdx.x) : "memory");
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(&full)) : "memory");
    } else {                                           // consumer warp: wait for phase 0, then read
        asm volatile("{\n .reg .pred done;\nWAIT_%=:\n"
                     " mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"   // test_wait: sm_80 (try_wait is sm_90)
                     " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(&full)), "r"(0) : "memory");
        float acc = 0.f;
        for (int j = lane; j < TILE / 4; j += 32) {
            const float4 v = tile[j];
            acc += (v.x + v.y) + (v.z + v.w);
        }
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) out[0] = acc;
    }
}
