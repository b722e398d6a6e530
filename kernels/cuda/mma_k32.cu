// Two m16n8k32 forms of mma.sync, fragments in and out, one warp each (PTX ISA, "Matrix Fragments for
// mma.m16n8k32" and "Sparse matrix multiply-accumulate: mma.sp"); g = lane >> 2, t = lane & 3.
//
// Kernel mma_fp8_m16n8k32: D (16x8 f32) = A (16x32 e4m3, row) B (32x8 e4m3, col) + 0.
//   A: four .b32 registers of four e4m3 each, a_i = A[g + 8*((i/4)%2)][4t + (i%4) + 16*(i/8)], i = 0..15
//   B: two .b32 registers, b_i = B[4t + (i%4) + 16*(i/4)][g], i = 0..7;  C/D as for m16n8k16.
//   In bytes these are the m16n8k16 f16 layouts: register r of a lane holds the same four bytes of the
//   same row (kernels/ptx/fragments.py: register_bytes). sm_89 and sm_120 have a native instruction
//   (QMMA); ptxas refuses the form below sm_89.
//
// Kernel mma_sp_m16n8k32: 2:4 structured sparsity, f16 in, f32 out. A is logically 16x32 with at most
//   two non-zeros in every four consecutive elements of a row; only those are stored, as a 16x16 fragment
//   in the dense m16n8k16 A layout, and a 32-bit metadata register e holds the 2-bit position of each
//   kept element within its group of four. The sparsity selector (0 here) names which threads of each
//   quad supply the metadata. B is the dense 32x8 operand (four .b32 registers). The zero half of A is
//   never multiplied: NVIDIA quotes twice the dense math rate for this form (nvidia2020a100whitepaper).
//   The metadata's bit layout is not emulated in kernels/ptx/fragments.py.
#include <cstdint>

extern "C" __global__ void mma_fp8_m16n8k32(const uint32_t* __restrict__ af, const uint32_t* __restrict__ bf,
                                            float* __restrict__ out) {
    const int lane = threadIdx.x;
    uint32_t a[4], b[2];
    for (int i = 0; i < 4; ++i) a[i] = af[lane * 4 + i];
    for (int i = 0; i < 2; ++i) b[i] = bf[lane * 2 + i];
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = d[i];
}

extern "C" __global__ void mma_sp_m16n8k32(const uint32_t* __restrict__ af, const uint32_t* __restrict__ bf,
                                           const uint32_t* __restrict__ meta, float* __restrict__ out) {
    const int lane = threadIdx.x;
    uint32_t a[4], b[4];
    for (int i = 0; i < 4; ++i) {
        a[i] = af[lane * 4 + i];
        b[i] = bf[lane * 4 + i];
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    asm volatile(
        "mma.sp.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(meta[lane]));
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = d[i];
}
