// CUTLASS's two Hopper warp-specialized GEMM kernels, instantiated for one fp16 GEMM
// (A row-major M x K, B column-major K x N, C row-major, fp32 accumulation), compiled by
// kernels.gemm.cutlass_sm90 with the course's nvcc for sm_90a to read what the hardware runs:
//   cooperative: KernelTmaWarpSpecializedCooperative, 128x128x64 tile, both consumer warp groups on it;
//   ping-pong:   KernelTmaWarpSpecializedPingpong,    64x128x64 tile,  each consumer group its own tile.
// Both through CUTLASS's CollectiveBuilder (the stage count is the builder's: as many as fit next to
// the epilogue's shared memory). Nothing is launched; the kernels are instantiated explicitly below.
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;

using ElementA = cutlass::half_t;   using LayoutA = cutlass::layout::RowMajor;
using ElementB = cutlass::half_t;   using LayoutB = cutlass::layout::ColumnMajor;
using ElementC = cutlass::half_t;   using LayoutC = cutlass::layout::RowMajor;
using ElementAcc = float;
constexpr int kAlign = 8;           // 8 halves = 16 bytes, what TMA needs

template <class TileShape, class MainloopSchedule, class EpilogueSchedule>
struct Sm90Gemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, Shape<_1, _1, _1>,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
      ElementC, LayoutC, kAlign, ElementC, LayoutC, kAlign, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlign, ElementB, LayoutB, kAlign,
      ElementAcc, TileShape, Shape<_1, _1, _1>,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
};

using Cooperative = Sm90Gemm<Shape<_128, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                             cutlass::epilogue::TmaWarpSpecializedCooperative>::Kernel;
using Pingpong = Sm90Gemm<Shape<_64, _128, _64>, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                          cutlass::epilogue::TmaWarpSpecialized>::Kernel;

// The facts the course reads back, as constants in the cubin's host-independent form.
extern "C" __global__ void cutlass_sm90_facts(int* out) {
  out[0] = Cooperative::MaxThreadsPerBlock;  out[1] = Pingpong::MaxThreadsPerBlock;
  out[2] = Cooperative::SharedStorageSize;   out[3] = Pingpong::SharedStorageSize;
  out[4] = Cooperative::CollectiveMainloop::DispatchPolicy::Stages;
  out[5] = Pingpong::CollectiveMainloop::DispatchPolicy::Stages;
}

template __global__ void cutlass::device_kernel<Cooperative>(CUTLASS_GRID_CONSTANT Cooperative::Params const);
template __global__ void cutlass::device_kernel<Pingpong>(CUTLASS_GRID_CONSTANT Pingpong::Params const);
