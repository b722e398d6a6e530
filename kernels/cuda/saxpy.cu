// y[i] = a * x[i] + y[i]: the smallest kernel that loads, computes and stores.
// One thread per element; the bounds check lets n be any size.
// Compiled ahead of time by kernels.inspect.compile_cuda; the start chapter reads its PTX and SASS.
extern "C" __global__ void saxpy(float a, const float* __restrict__ x, float* __restrict__ y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;  // global thread index
    if (i < n) {
        y[i] = a * x[i] + y[i];                       // one fused multiply-add
    }
}
