// ldmatrix: one warp loads 8x8 tiles of 16-bit elements from shared memory into registers, already
// laid out as tensor-core fragments.
//
// Each kernel is launched with one warp. It copies `tile` (512 16-bit elements) into shared memory,
// then every lane passes the shared address of element addr[lane] (lanes 0..8*NUM-1 supply the
// rows of matrices 0..NUM-1; the rest are ignored) to ldmatrix and stores the NUM 32-bit registers
// it receives in out[lane * NUM + r]. kernels/ptx/fragments.py:ldmatrix emulates the same thing.
// PTX ISA: "Warp-level matrix load instruction: ldmatrix" (sm_75 and later).
#include <cstdint>

template <int NUM, bool TRANS>
__device__ __forceinline__ void load_fragments(const uint16_t* __restrict__ tile, const int* __restrict__ addr, uint32_t* __restrict__ out) {
    __shared__ __align__(16) uint16_t smem[512];
    const int lane = threadIdx.x;
    for (int i = lane; i < 512; i += 32) smem[i] = tile[i];
    __syncthreads();
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem + addr[lane]));
    uint32_t r[4] = {0u, 0u, 0u, 0u};
    if (NUM == 1 && !TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
    if (NUM == 2 && !TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    if (NUM == 4 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    if (NUM == 1 && TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
    if (NUM == 2 && TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    if (NUM == 4 && TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    for (int i = 0; i < NUM; ++i) out[lane * NUM + i] = r[i];
}

extern "C" __global__ void ldmatrix_x1(const uint16_t* t, const int* a, uint32_t* o) { load_fragments<1, false>(t, a, o); }
extern "C" __global__ void ldmatrix_x2(const uint16_t* t, const int* a, uint32_t* o) { load_fragments<2, false>(t, a, o); }
extern "C" __global__ void ldmatrix_x4(const uint16_t* t, const int* a, uint32_t* o) { load_fragments<4, false>(t, a, o); }
extern "C" __global__ void ldmatrix_x1_trans(const uint16_t* t, const int* a, uint32_t* o) { load_fragments<1, true>(t, a, o); }
extern "C" __global__ void ldmatrix_x2_trans(const uint16_t* t, const int* a, uint32_t* o) { load_fragments<2, true>(t, a, o); }
extern "C" __global__ void ldmatrix_x4_trans(const uint16_t* t, const int* a, uint32_t* o) { load_fragments<4, true>(t, a, o); }
