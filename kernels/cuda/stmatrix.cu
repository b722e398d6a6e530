// stmatrix and movmatrix: the 16-bit register layouts of ldmatrix, run the other way and in place.
//
// stmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA, "Warp-level matrix store instruction:
// stmatrix", sm_90): every lane holds four 32-bit registers in ldmatrix.x4's layout (register r of
// lane l: row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of matrix r, or the transpose with .trans),
// and lane 8m + q supplies the shared address of row q of matrix m. The warp writes the four 8x8
// matrices there. Epilogues use it to put accumulators (packed to 16 bits) into shared memory before
// a TMA store (CuTe's SM90_U32x4_STSM_N).
//
// movmatrix.sync.aligned.m8n8.trans.b16 (PTX ISA, "movmatrix", sm_75): one 32-bit register per lane
// holds an 8x8 matrix in the same layout; the warp gets back the registers of its transpose.
//
// Kernels, one warp each; kernels/ptx/fragments.py emulates both (stmatrix, movmatrix):
//   stmatrix_x4 / stmatrix_x4_trans: shared memory (512 16-bit elements) starts as 0xFFFF; regs
//     (32 x 4 words) are stored through addresses addr[lane] (element offsets); out = shared memory.
//   movmatrix_trans: out[lane] = movmatrix(in[lane]).
#include <cstdint>

template <bool TRANS>
__device__ __forceinline__ void store_fragments(const uint32_t* __restrict__ regs, const int* __restrict__ addr,
                                                uint16_t* __restrict__ out) {
    __shared__ __align__(16) uint16_t smem[512];
    const int lane = threadIdx.x;
    for (int i = lane; i < 512; i += 32) smem[i] = 0xFFFFu;
    __syncwarp();
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem + addr[lane]));
    const uint32_t r0 = regs[lane * 4], r1 = regs[lane * 4 + 1], r2 = regs[lane * 4 + 2], r3 = regs[lane * 4 + 3];
    if (TRANS)
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     ::"r"(a), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
    else
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     ::"r"(a), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
    __syncwarp();
    for (int i = lane; i < 512; i += 32) out[i] = smem[i];
}

extern "C" __global__ void stmatrix_x4(const uint32_t* regs, const int* addr, uint16_t* out) {
    store_fragments<false>(regs, addr, out);
}

extern "C" __global__ void stmatrix_x4_trans(const uint32_t* regs, const int* addr, uint16_t* out) {
    store_fragments<true>(regs, addr, out);
}

extern "C" __global__ void movmatrix_trans(const uint32_t* __restrict__ in, uint32_t* __restrict__ out) {
    uint32_t d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(in[threadIdx.x]));
    out[threadIdx.x] = d;
}
