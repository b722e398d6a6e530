// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: one warp computes D (16x8) = A (16x16) B (16x8) + C.
//
// Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane >> 2 (groupID) and t = lane & 3 (threadID_in_group):
//   A: a_i = A[g + 8*((i/2)%2)][2t + (i%2) + 8*(i/4)],  i = 0..7, two f16 per 32-bit register
//   B: b_i = B[2t + (i%2) + 8*(i/2)][g],                 i = 0..3
//   C, D: c_i = C[g + 8*(i/2)][2t + (i%2)],              i = 0..3, one f32 per register
// kernels/ptx/fragments.py transcribes the same layouts and emulates the instruction.
#include <cstdint>
#include <cuda_fp16.h>

__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// Registers in, registers out: a_regs (32 x 4 words), b_regs (32 x 2), c (32 x 4), d (32 x 4).
// The host distributes the matrices with the emulation's layout; this checks that layout against the hardware.
extern "C" __global__ void mma_m16n8k16_fragments(const uint32_t* a_regs, const uint32_t* b_regs, const float* c, float* d) {
    const int lane = threadIdx.x;
    uint32_t a[4], b[2];
    float cc[4], dd[4];
    for (int i = 0; i < 4; ++i) a[i] = a_regs[lane * 4 + i];
    for (int i = 0; i < 2; ++i) b[i] = b_regs[lane * 2 + i];
    for (int i = 0; i < 4; ++i) cc[i] = c[lane * 4 + i];
    mma_16816(dd, a, b, cc);
    for (int i = 0; i < 4; ++i) d[lane * 4 + i] = dd[i];
}

// Matrices in, matrix out, the way a real kernel feeds the tensor core: stage A (16x16, row-major)
// and B (16x8, row-major, i.e. k-major) in shared memory, load A with ldmatrix.x4 and B with
// ldmatrix.x2.trans, multiply, store D (16x8 fp32, row-major) from the C/D layout.
extern "C" __global__ void mma_m16n8k16_tile(const __half* A, const __half* B, const float* C, float* D) {
    __shared__ __align__(16) __half As[16 * 16];
    __shared__ __align__(16) __half Bs[16 * 8];
    const int lane = threadIdx.x;
    for (int i = lane; i < 256; i += 32) As[i] = A[i];
    for (int i = lane; i < 128; i += 32) Bs[i] = B[i];
    __syncthreads();
    uint32_t a[4], b[2];
    const unsigned pa = static_cast<unsigned>(__cvta_generic_to_shared(&As[(lane % 16) * 16 + 8 * (lane / 16)]));
    const unsigned pb = static_cast<unsigned>(__cvta_generic_to_shared(&Bs[(lane % 16) * 8]));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(pa));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(b[0]), "=r"(b[1]) : "r"(pb));
    const int g = lane >> 2, t = lane & 3;
    float c[4], d[4];
    for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i / 2)) * 8 + 2 * t + (i % 2)];
    mma_16816(d, a, b, c);
    for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + (i % 2)] = d[i];
}

// D (M x N fp32) = A (M x K fp16, row-major) B (K x N fp16, row-major): one warp per 16x8 tile of D,
// stepping K by 16, fragments read straight from global memory by the layout (no shared memory).
// Needs M % 16 == 0, N % 8 == 0, K % 16 == 0 (the launcher checks). Grid: (N/8, M/16), 32 threads.
extern "C" __global__ void mma_gemm(const __half* A, const __half* B, float* D, int M, int N, int K) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * 16, n0 = blockIdx.x * 8;
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k0 = 0; k0 < K; k0 += 16) {
        uint32_t a[4], b[2];
        for (int r = 0; r < 4; ++r) {                // register r holds elements i = 2r, 2r+1
            const int row = m0 + g + 8 * (r % 2), col = k0 + 2 * t + 8 * (r / 2);
            __half2 h = __halves2half2(A[(size_t)row * K + col], A[(size_t)row * K + col + 1]);
            a[r] = *reinterpret_cast<uint32_t*>(&h);
        }
        for (int r = 0; r < 2; ++r) {
            const int k = k0 + 2 * t + 8 * r;
            __half2 h = __halves2half2(B[(size_t)k * N + n0 + g], B[(size_t)(k + 1) * N + n0 + g]);
            b[r] = *reinterpret_cast<uint32_t*>(&h);
        }
        float c[4] = {d[0], d[1], d[2], d[3]};
        mma_16816(d, a, b, c);
    }
    for (int i = 0; i < 4; ++i) D[(size_t)(m0 + g + 8 * (i / 2)) * N + n0 + 2 * t + (i % 2)] = d[i];
}
