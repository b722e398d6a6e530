// MXFP4 quantization of fp32 data, the activation side of a block-scaled GEMM, written with the two
// Blackwell conversion instructions that do the rounding (PTX ISA 8.6+, sm_100a / sm_120a):
//
//   cvt.rp.satfinite.ue8m0x2.f32   the block scale: X = 2^ceil(log2(amax / 6)), E8M0, round toward +inf
//                                  (the round-up rule of kernels.quant.microscaling, rule="up")
//   cvt.rn.satfinite.e2m1x2.f32    two elements V / X to E2M1 codes in one byte, RNE, clamped to +-6
//
// One warp per block of 32 consecutive elements: lane l holds element l, the warp reduces |V| with
// shuffles, every lane scales its element by 1 / X (exact: a power of two), and the even lanes pack
// their element (low nibble) with their odd neighbour's (high nibble), the order tl.dot_scaled reads.
// Compiled ahead of time by kernels.inspect.compile_cuda; the microscaling chapter reads its PTX and
// SASS. Output layout: codes[n / 2] (two per byte), scales[n / 32] (E8M0 codes, row-major, unswizzled).
#include <cstdint>

// E8M0 code of q rounded up to a power of two; 0 -> code 0 (2^-127, satfinite: E8M0 has no zero).
__device__ __forceinline__ uint32_t e8m0_round_up(float q) {
    uint16_t pair;  // cvt ...x2 d, a, b puts a in the upper byte and b in the lower one
    asm("cvt.rp.satfinite.ue8m0x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(q));
    return pair & 0xFFu;
}

// One byte of two E2M1 codes: lo in bits 0-3 (element 2j), hi in bits 4-7 (element 2j + 1).
__device__ __forceinline__ uint8_t e2m1x2(float lo, float hi) {
    uint16_t byte;
    asm("{\n\t.reg .b8 t;\n\tcvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n\tcvt.u16.u8 %0, t;\n\t}"
        : "=h"(byte) : "f"(hi), "f"(lo));
    return static_cast<uint8_t>(byte);
}

extern "C" __global__ void mxfp4_quantize(const float* __restrict__ x,  // (n,) fp32, n a multiple of 32
                                          uint8_t* __restrict__ codes,  // (n / 2,) packed E2M1
                                          uint8_t* __restrict__ scales, // (n / 32,) E8M0
                                          int64_t n_blocks) {
    const int64_t block = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // int64: n > 2^31
    const int lane = threadIdx.x % 32;
    if (block >= n_blocks) return;                               // whole warps leave together
    const float v = x[block * 32 + lane];
    float amax = fabsf(v);
    for (int offset = 16; offset > 0; offset /= 2)               // amax = max_i |V_i| over the warp
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
    const uint32_t s = e8m0_round_up(amax * (1.0f / 6.0f));     // X = 2^(s - 127), amax / X in (3, 6]
    const float y = v * ldexpf(1.0f, 127 - static_cast<int>(s)); // V / X, exact
    const float y_odd = __shfl_down_sync(0xFFFFFFFFu, y, 1);     // element 2j + 1, for lane 2j
    if (lane % 2 == 0) codes[(block * 32 + lane) / 2] = e2m1x2(y, y_odd);
    if (lane == 0) scales[block] = static_cast<uint8_t>(s);
}
