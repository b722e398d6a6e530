// N tiny kernels in a chain, launched one by one on a stream and then as one CUDA graph.
//
// Each kernel is one step of x <- a * x + b over a small vector (one block's worth of work), so its
// run time on the GPU is far below what it costs the CPU to launch it: the chain is launch bound,
// like a decode step of a small batch. Two ways to run the same chain:
//
//   eager  N x  chain_step<<<grid, block, 0, stream>>>(...)      one launch call per kernel
//   graph  cudaStreamBeginCapture(stream) ... the same N launches ... cudaStreamEndCapture -> graph,
//          cudaGraphInstantiate(graph) -> exec, then cudaGraphLaunch(exec, stream): one call per chain
//
// During capture the launches are recorded, not run (CUDA Programming Guide, "CUDA Graphs: stream
// capture"). The program checks that both ways give the same vector bit for bit, then prints the
// wall time per chain of each (host clock around a stream synchronize).
//
// Usage: graph_chain [N kernels, default 64] [repetitions, default 200]
// Built by kernels.serving.cuda_graphs.build_chain_program; runs only on a machine with a GPU.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(call)                                                                            \
    do {                                                                                       \
        cudaError_t err_ = (call);                                                             \
        if (err_ != cudaSuccess) {                                                             \
            std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(err_));          \
            std::exit(1);                                                                      \
        }                                                                                      \
    } while (0)

// x[i] <- a * x[i] + b for i < n: a few nanoseconds of work per thread
extern "C" __global__ void chain_step(float* __restrict__ x, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fmaf(a, x[i], b);
}

static void launch_chain(float* x, int n, int kernels, cudaStream_t stream) {
    for (int k = 0; k < kernels; ++k) {
        float a = 1.0f - 1e-3f * (k % 7), b = 1e-2f * (k % 5);   // each step its own constants
        chain_step<<<(n + 255) / 256, 256, 0, stream>>>(x, a, b, n);
    }
}

static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char** argv) {
    const int kernels = argc > 1 ? std::atoi(argv[1]) : 64;
    const int reps = argc > 2 ? std::atoi(argv[2]) : 200;
    const int n = 256;
    if (kernels < 1 || reps < 1) {
        std::fprintf(stderr, "usage: graph_chain [kernels >= 1] [repetitions >= 1]\n");
        return 2;
    }
    std::vector<float> init(n), eager(n), graphed(n);
    for (int i = 0; i < n; ++i) init[i] = 0.001f * i;
    float *x_eager, *x_graph;
    CHECK(cudaMalloc(&x_eager, n * sizeof(float)));
    CHECK(cudaMalloc(&x_graph, n * sizeof(float)));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));   // capture needs a non-default stream

    // eager: one launch call per kernel
    CHECK(cudaMemcpy(x_eager, init.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    launch_chain(x_eager, n, kernels, stream);                           // warm-up (module load)
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaMemcpy(x_eager, init.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) launch_chain(x_eager, n, kernels, stream);
    CHECK(cudaStreamSynchronize(stream));
    const double t_eager = seconds_since(t0) / reps;

    // graph: record the same chain once, instantiate, then one launch call per chain
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    launch_chain(x_graph, n, kernels, stream);                           // recorded, not run
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    CHECK(cudaMemcpy(x_graph, init.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaGraphLaunch(exec, stream));                                // warm-up (upload)
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaMemcpy(x_graph, init.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaStreamSynchronize(stream));
    const double t_graph = seconds_since(t0) / reps;

    CHECK(cudaMemcpy(eager.data(), x_eager, n * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(graphed.data(), x_graph, n * sizeof(float), cudaMemcpyDeviceToHost));
    const bool same = std::memcmp(eager.data(), graphed.data(), n * sizeof(float)) == 0;
    std::printf("kernels %d nodes %zu reps %d eager_us_per_chain %.3f graph_us_per_chain %.3f same %d\n",
                kernels, nodes, reps, t_eager * 1e6, t_graph * 1e6, same ? 1 : 0);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaStreamDestroy(stream));
    CHECK(cudaFree(x_eager));
    CHECK(cudaFree(x_graph));
    return same ? 0 : 1;
}
