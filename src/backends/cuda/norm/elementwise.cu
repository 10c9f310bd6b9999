// CUDA elementwise helpers: relu2 (in place), add, copy_columns / write_columns (strided copies). Grid-stride loops
// over 16-byte groups with a scalar tail; fp32 math, one rounding per stored element (the CPU reference rounds the same
// way in fp32).
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/launch.cuh"

namespace chimera::cuda {
namespace {

constexpr int kThreads = 256;

struct ElementwiseParams {
  void* out;      // [n] T
  const void* a;  // [n] T
  const void* b;  // [n] T (add), else null
  int64_t n;
};

enum class Elementwise { kRelu2, kAdd };

template <Elementwise kOp, int N>
__device__ __forceinline__ void apply(float (&a)[N], const float (&b)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if constexpr (kOp == Elementwise::kRelu2) {
      const float r = fmaxf(a[j], 0.0f);
      a[j] = r * r;
    } else {
      a[j] += b[j];
    }
  }
}

// Elements [0, n / N * N) in groups of N, then the tail one by one. relu2 reads a == out in place, so its
// loads take the coherent path.
template <Elementwise kOp, typename T, int N>
__global__ void elementwise_kernel(const ElementwiseParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = p.n / N;
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  T* out = static_cast<T*>(p.out);
  pdl_wait();  // PDL: a and b are earlier kernels' outputs
  pdl_trigger();
  for (int64_t i = first; i < n_vec; i += stride) {
    float va[N], vb[N];
    load_f32<T, N, false>(a + i * N, va);
    if constexpr (kOp == Elementwise::kAdd) {
      load_f32<T, N, false>(b + i * N, vb);
    }
    apply<kOp, N>(va, vb);
    store_f32<T, N>(out + i * N, va);
  }
  for (int64_t i = n_vec * N + first; i < p.n; i += stride) {
    float va[1], vb[1];
    load_f32<T, 1, false>(a + i, va);
    if constexpr (kOp == Elementwise::kAdd) {
      load_f32<T, 1, false>(b + i, vb);
    }
    apply<kOp, 1>(va, vb);
    store_f32<T, 1>(out + i, va);
  }
}

template <Elementwise kOp>
void launch_elementwise(const ElementwiseParams& p, DType dtype, cudaStream_t stream, const char* op) {
  if (p.n == 0) return;
  const int sms = sm_count();
  const bool aligned = vec_aligned({p.out, p.a, p.b});
  CHIMERA_DISPATCH_FLOAT(dtype, op, T, {
    constexpr int kN = vec_width<T>();
    const int64_t groups = aligned ? p.n / kN : p.n;
    // Enough blocks to fill the chip several times over, no more (grid-stride beyond that).
    const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(groups, kThreads), 8LL * sms)));
    if (aligned) {
      launch(elementwise_kernel<kOp, T, kN>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, p);
    } else {
      launch(elementwise_kernel<kOp, T, 1>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, p);
    }
  });
  CHIMERA_LAUNCH_CHECK(op);
}

}  // namespace

void relu2(const ops::Context& ctx, const Tensor& x) {
  const ElementwiseParams p{x.data(), x.data(), nullptr, x.numel()};
  launch_elementwise<Elementwise::kRelu2>(p, x.dtype(), as_stream(ctx.stream), "ops::relu2");
}

void add(const ops::Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  require_same_dtype("ops::add", {{"a", &a}, {"b", &b}, {"out", &out}});
  const ElementwiseParams p{out.data(), a.data(), b.data(), out.numel()};
  launch_elementwise<Elementwise::kAdd>(p, out.dtype(), as_stream(ctx.stream), "ops::add");
}

// A strided 2-D copy: T rows of w elements from a row pitch of W elements, offset col_begin.
void copy_columns(const ops::Context& ctx, const Tensor& out, const Tensor& in, int64_t col_begin) {
  require_same_dtype("ops::copy_columns", {{"in", &in}, {"out", &out}});
  const int64_t T = out.dim(0), w = out.dim(1), W = in.dim(1);
  if (T == 0 || w == 0) return;
  const size_t es = dtype_size(in.dtype());
  const auto* src = static_cast<const char*>(in.data()) + static_cast<size_t>(col_begin) * es;
  CHIMERA_CUDA_CHECK(cudaMemcpy2DAsync(out.data(), static_cast<size_t>(w) * es, src, static_cast<size_t>(W) * es,
                                       static_cast<size_t>(w) * es, static_cast<size_t>(T), cudaMemcpyDeviceToDevice,
                                       as_stream(ctx.stream)),
                     "ops::copy_columns");
}

void write_columns(const ops::Context& ctx, const Tensor& out, const Tensor& in, int64_t col_begin) {
  require_same_dtype("ops::write_columns", {{"in", &in}, {"out", &out}});
  const int64_t T = in.dim(0), w = in.dim(1), W = out.dim(1);
  if (T == 0 || w == 0) return;
  const size_t es = dtype_size(in.dtype());
  auto* dst = static_cast<char*>(out.data()) + static_cast<size_t>(col_begin) * es;
  CHIMERA_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<size_t>(W) * es, in.data(), static_cast<size_t>(w) * es,
                                       static_cast<size_t>(w) * es, static_cast<size_t>(T), cudaMemcpyDeviceToDevice,
                                       as_stream(ctx.stream)),
                     "ops::write_columns");
}

}  // namespace chimera::cuda
