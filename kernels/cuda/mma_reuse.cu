// The accumulator of one mma.sync is the A operand of the next, with no data movement between lanes.
//
// mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), g = lane >> 2,
// t = lane & 3:
//   C/D of a 16x8 tile: c_i = C[g + 8*(i/2)][2t + (i%2)],                  i = 0..3 (one f32 each)
//   A of a 16x16 tile:  a_i = A[g + 8*((i/2)%2)][2t + (i%2) + 8*(i/4)],     i = 0..7 (two f16 per register)
// So for a 16x16 tile P whose columns 0..7 are accumulator tile L and 8..15 tile R, the A element a_i
// is L's c_i for i < 4 and R's c_(i-4) for i >= 4, in the same lane: a thread converts its own eight
// f32 values to f16 and packs them in pairs (kernels/ptx/fragments.py: c_to_a). This is how
// FlashAttention-2 multiplies P = softmax(S) by V straight from registers (dao2023flashattention2).
//
// Kernel mma_p_in_registers, one warp, fragments in and out (the layouts above):
//   S = Q K^T as two m16n8k16 tiles (columns 0..7 with kf[0..1], 8..15 with kf[2..3]),
//   P = fp16(S) repacked as an A fragment, O = P V (one m16n8k16 with V's B fragment vf).
#include <cstdint>
#include <cuda_fp16.h>

__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {   // element 2j in the low half
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}

extern "C" __global__ void mma_p_in_registers(const uint32_t* __restrict__ qf, const uint32_t* __restrict__ kf,
                                              const uint32_t* __restrict__ vf, float* __restrict__ out) {
    const int lane = threadIdx.x;
    uint32_t q[4], k0[2], k1[2], v[2];
    for (int i = 0; i < 4; ++i) q[i] = qf[lane * 4 + i];
    for (int i = 0; i < 2; ++i) {
        k0[i] = kf[lane * 4 + i];
        k1[i] = kf[lane * 4 + 2 + i];
        v[i] = vf[lane * 2 + i];
    }
    float s_left[4] = {0.f, 0.f, 0.f, 0.f}, s_right[4] = {0.f, 0.f, 0.f, 0.f};
    mma_16816(s_left, q, k0);                       // S[:, 0:8]
    mma_16816(s_right, q, k1);                      // S[:, 8:16]
    // a_0..a_3 = s_left c_0..c_3, a_4..a_7 = s_right c_0..c_3: register r holds a_2r, a_2r+1
    const uint32_t p[4] = {pack_f16x2(s_left[0], s_left[1]), pack_f16x2(s_left[2], s_left[3]),
                           pack_f16x2(s_right[0], s_right[1]), pack_f16x2(s_right[2], s_right[3])};
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    mma_16816(o, p, v);                             // O = P V, P never left the registers
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = o[i];
}
