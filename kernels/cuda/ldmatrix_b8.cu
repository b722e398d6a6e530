// The 8-bit ldmatrix with a transpose: ldmatrix.sync.aligned.m16n16.x1.trans.shared.b8 (PTX ISA,
// "ldmatrix", the .m16n16 shape with .b8 elements; sm_100a and sm_120a here, refused on sm_90a).
// The 16-bit .trans of m8n8 exchanges 16-bit elements, so it cannot transpose a tile of 8-bit ones;
// this form transposes 8-bit elements on the way into registers. Lanes 0..15 give the addresses of the
// 16 rows (16 bytes each); every lane receives two 32-bit registers. Compiled for its SASS only: its
// register layout is not emulated in kernels/ptx/fragments.py.
#include <cstdint>

extern "C" __global__ void ldmatrix_b8_m16n16_trans(const uint8_t* __restrict__ tile, uint32_t* __restrict__ out) {
    __shared__ __align__(16) uint8_t smem[256];
    const int lane = threadIdx.x;
    for (int i = lane; i < 256; i += 32) smem[i] = tile[i];
    __syncwarp();
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem + 16 * (lane % 16)));
    uint32_t r0, r1;
    asm volatile("ldmatrix.sync.aligned.m16n16.x1.trans.shared.b8 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
    out[lane * 2] = r0;
    out[lane * 2 + 1] = r1;
}
