// Three wgmma forms beside kernels/cuda/wgmma.cu's SS (both operands from shared memory), sm_90a.
//
// PTX ISA (nvidia2025ptx), "wgmma.mma_async":
//   wgmma_rs_m64n64k16: A from REGISTERS (the "RS" form FlashAttention-3 uses for P V: P stays in the
//     registers the softmax wrote). Each thread holds four .b32 registers of A, in the layout of
//     mma.m16n8k16's A per warp (warp w of the warpgroup owns rows 16w..16w+15). Operands after the
//     descriptor of B: scale-d, imm-scale-a, imm-scale-b, imm-trans-b (no trans-a: A is in registers).
//   wgmma_fp8_m64n64k32: e4m3 x e4m3 -> f32, K = 32 per instruction. The fp8 forms take no imm-trans
//     operands at all: both operands must be K-major in shared memory (defining WGMMA_FP8_TRANS adds a
//     transpose flag, which ptxas refuses). This is why FP8 attention and GEMM kernels transpose V or B.
//   wgmma_pipelined: K/16 SS steps, each committed as its own group; wait_group 1 lets the newest group
//     run while the thread goes on (a real kernel releases the previous stage's shared memory there),
//     then wait_group 0 before the accumulator is read.
// Compiled for their SASS; the descriptors come from the host (kernels/ptx/wgmma.py encodes them).
#include <cstdint>

#define D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define D32_OUT(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
    "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), \
    "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

__device__ __forceinline__ void store_accumulator(const float d[32], float* out) {
    for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}

extern "C" __global__ void __launch_bounds__(128) wgmma_rs_m64n64k16(const uint32_t* a_regs, uint64_t desc_b, float* out) {
    float d[32] = {0.f};
    uint32_t a[4];
    for (int i = 0; i < 4; ++i) a[i] = a_regs[threadIdx.x * 4 + i];
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " D32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
                 : D32_OUT(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    store_accumulator(d, out);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_fp8_m64n64k32(uint64_t desc_a, uint64_t desc_b, float* out) {
    float d[32] = {0.f};
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#ifdef WGMMA_FP8_TRANS
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " D32 ", %32, %33, 1, 1, 1, 0, 1;\n"
                 : D32_OUT(d) : "l"(desc_a), "l"(desc_b));
#else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " D32 ", %32, %33, 1, 1, 1;\n"
                 : D32_OUT(d) : "l"(desc_a), "l"(desc_b));
#endif
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    store_accumulator(d, out);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_pipelined(uint64_t desc_a, uint64_t desc_b, int k_steps, float* out) {
    float d[32] = {0.f};
    for (int k = 0; k < k_steps; ++k) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " D32 ", %32, %33, 1, 1, 1, 0, 0;\n"
                     : D32_OUT(d) : "l"(desc_a + 2 * k), "l"(desc_b + 2 * k));     // +32 bytes: the next k16 step
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");          // the step just issued may still run
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    store_accumulator(d, out);
}
