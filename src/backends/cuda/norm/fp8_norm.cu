// add + RMSNorm + FP8 quant and gated RMSNorm + FP8 quant (gemm/fp8_linear.h): the row-normalisation kernel of
// norm/row_norm.cuh (kAdd / kGated) with the output stored as e4m3 codes instead of the activation dtype.
//
// Rounding points, chosen so that the codes are the bits of the unfused ops (add_rms_norm or gated_rms_norm, then
// quantize_fp8 of their output): the pre-norm value as row_norm.cuh computes it (kAdd: residual + x rounded to T and
// stored; kGated: y * silu(z) in fp32, not rounded), the same thread layout and butterfly for the sum of squares
// (so the same inverse RMS), o = w * (v * inv) in fp32, then o rounded to T (what the unfused kernel stores and the
// quantizer reads), then e4m3(round_T(o) / input_scale) with the quantizer's IEEE division and saturation. With F32
// activations round_T is the identity. The vector width and the vector groups per thread follow the unfused launch
// (16-byte accesses when the row length and every pointer allow them, out_q included at its 1-byte-per-element
// width), so aligned tensors give identical bits.
#include "backends/cuda/gemm/fp8_linear.h"
#include "backends/cuda/gemm/fp8_quant.cuh"
#include "backends/cuda/norm/row_norm.cuh"
#include "backends/device_api.h"

namespace chimera::cuda {
namespace norm {
namespace {

// N normalised values (fp32) -> N e4m3 bytes of round_T(o) / scale.
template <typename T, int N>
__device__ __forceinline__ void store_q(const RowNormParams& p, size_t e, const float (&o)[N], float scale) {
  float r[N];
#pragma unroll
  for (int j = 0; j < N; ++j) r[j] = round_to<T>(o[j]);
  fp8::store_quantized<N>(static_cast<uint8_t*>(p.out) + e, r, scale);
}

template <NormMode kMode, typename T, typename W, int N, int kVecs>
__global__ void __launch_bounds__(kMaxThreads) row_norm_fp8_kernel(const RowNormParams p, float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < p.rows;
  const int n_vec = p.row_len / N;
  const size_t base = static_cast<size_t>(active ? row : 0) * static_cast<size_t>(p.row_len);
  const size_t w_base = static_cast<size_t>(active ? row % p.weight_rows : 0) * static_cast<size_t>(p.row_len);
  pdl_wait();  // x, z and residual are earlier kernels' outputs; residual and out_q may still be read by them
  pdl_trigger();
  float ss = 0.0f;
  if constexpr (kVecs > 0) {
    RawVec<T, N> ra[kVecs], rb[kVecs], rc[kVecs];
    RawVec<W, N> rw[kVecs];
    constexpr bool kKeepF32 = kMode == NormMode::kGated;
    float gv[kKeepF32 ? kVecs : 1][N];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (active && i < n_vec) row_load<kMode, T, N>(p, base + static_cast<size_t>(i) * N, ra[k], rb[k], rc[k]);
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (active && i < n_vec) {
        float v[N];
        row_combine<kMode, T, N>(p, base + static_cast<size_t>(i) * N, ra[k], rb[k], rc[k], v);
#pragma unroll
        for (int j = 0; j < N; ++j) ss += v[j] * v[j];
        if constexpr (kKeepF32) {
#pragma unroll
          for (int j = 0; j < N; ++j) gv[k][j] = v[j];
        }
      }
    }
    const float inv = 1.0f / sqrtf(row_sum(ss) / static_cast<float>(p.row_len) + p.eps);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (active && i < n_vec) {
        load_raw<W, N>(static_cast<const W*>(p.weight) + w_base + static_cast<size_t>(i) * N, rw[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (active && i < n_vec) {
        float v[N], w[N], o[N];
        if constexpr (kKeepF32) {
#pragma unroll
          for (int j = 0; j < N; ++j) v[j] = gv[k][j];
        } else {
          raw_to_f32<T, N>(ra[k], v);
        }
        raw_to_f32<W, N>(rw[k], w);
#pragma unroll
        for (int j = 0; j < N; ++j) o[j] = w[j] * (v[j] * inv);
        store_q<T, N>(p, base + static_cast<size_t>(i) * N, o, scale);
      }
    }
  } else {
    for (int i = static_cast<int>(threadIdx.x); active && i < n_vec; i += static_cast<int>(blockDim.x)) {
      float v[N];
      row_value<kMode, T, N>(p, base + static_cast<size_t>(i) * N, true, v);
#pragma unroll
      for (int j = 0; j < N; ++j) ss += v[j] * v[j];
    }
    const float inv = 1.0f / sqrtf(row_sum(ss) / static_cast<float>(p.row_len) + p.eps);
    for (int i = static_cast<int>(threadIdx.x); active && i < n_vec; i += static_cast<int>(blockDim.x)) {
      float v[N], w[N], o[N];
      row_value<kMode, T, N>(p, base + static_cast<size_t>(i) * N, false, v);
      load_f32<W, N>(static_cast<const W*>(p.weight) + w_base + static_cast<size_t>(i) * N, w);
#pragma unroll
      for (int j = 0; j < N; ++j) o[j] = w[j] * (v[j] * inv);
      store_q<T, N>(p, base + static_cast<size_t>(i) * N, o, scale);
    }
  }
}

// launch_row_norm_n of row_norm.cuh with the FP8 kernel.
template <NormMode kMode, typename T, typename W, int N>
void launch_fp8_n(const RowNormParams& p, float scale, cudaStream_t stream, const char* op) {
  const int n_vec = p.row_len / N;
  const int vecs = N == 1 ? 4 : default_vecs_per_thread(n_vec);
  const int tpr = threads_per_row(n_vec, vecs);
  if (tpr == 0) {
    CHIMERA_CUDA_CHECK(launch(row_norm_fp8_kernel<kMode, T, W, N, 0>, dim3(static_cast<unsigned>(p.rows)),
                              dim3(kMaxThreads), 0, stream, p, scale),
                       op);
    return;
  }
  const int rpb = tpr <= 32 ? kSmallRowBlock / tpr : 1;
  const dim3 block(static_cast<unsigned>(tpr), static_cast<unsigned>(rpb));
  const dim3 grid(static_cast<unsigned>(ceil_div(p.rows, rpb)));
  if (N > 1 && vecs == 2) {
    CHIMERA_CUDA_CHECK(launch(row_norm_fp8_kernel<kMode, T, W, N, 2>, grid, block, 0, stream, p, scale), op);
  } else {
    CHIMERA_CUDA_CHECK(launch(row_norm_fp8_kernel<kMode, T, W, N, 4>, grid, block, 0, stream, p, scale), op);
  }
}

template <NormMode kMode>
void launch_fp8(const RowNormParams& p, DType act, DType weight, float scale, cudaStream_t stream, const char* op) {
  if (p.rows == 0 || p.row_len == 0) return;
  if (p.rows > 0x7fffffffLL) throw_runtime(str_cat(op, ": ", p.rows, " rows exceed one launch"));
  // The unfused launch's rule (launch_row_norm): every pointer 16-byte aligned and the row a multiple of the vector.
  const bool aligned = vec_aligned({p.out, p.x, p.z, p.residual, p.weight});
  CHIMERA_DISPATCH_FLOAT(act, str_cat(op, " activations"), T, {
    CHIMERA_DISPATCH_FLOAT(weight, str_cat(op, " weight"), W, {
      constexpr int kN = vec_width<T>();
      if (aligned && p.row_len % kN == 0) {
        launch_fp8_n<kMode, T, W, kN>(p, scale, stream, op);
      } else {
        launch_fp8_n<kMode, T, W, 1>(p, scale, stream, op);
      }
    });
  });
}

int checked_int(const char* op, const char* what, int64_t v) {
  if (v > 0x7fffffffLL) throw_runtime(str_cat(op, ": ", what, " ", v, " exceeds 2^31 - 1"));
  return static_cast<int>(v);
}

void check_q(const char* op, const Tensor& out_q, const Tensor& like, float input_scale) {
  if (!out_q || out_q.dtype() != DType::kF8E4M3 || out_q.shape() != like.shape() || out_q.device() != Device::kCuda) {
    throw_runtime(str_cat(op, ": out_q ", out_q ? out_q.describe() : std::string("(undefined)"),
                          " must be an F8_E4M3 CUDA tensor shaped like ", like.describe()));
  }
  if (!(input_scale > 0.0f)) throw_runtime(str_cat(op, ": input_scale ", input_scale, " must be positive"));
}

}  // namespace
}  // namespace norm

void add_rms_norm_fp8(const ops::Context& ctx, const Tensor& residual, const Tensor& out_q, const Tensor& x,
                      const Tensor& weight, float eps, float input_scale) {
  const char* op = "cuda::add_rms_norm_fp8";
  require_same_dtype(op, {{"x", &x}, {"residual", &residual}});
  norm::check_q(op, out_q, x, input_scale);
  const device::LaunchScope launch_scope(ctx.kernels.pdl);
  const norm::RowNormParams p{out_q.data(),
                              x.data(),
                              nullptr,
                              residual.data(),
                              weight.data(),
                              x.dim(0),
                              norm::checked_int(op, "hidden size", x.dim(1)),
                              1,
                              eps};
  norm::launch_fp8<norm::NormMode::kAdd>(p, x.dtype(), weight.dtype(), input_scale, as_stream(ctx.stream), op);
}

void gated_rms_norm_fp8(const ops::Context& ctx, const Tensor& out_q, const Tensor& y, const Tensor& z,
                        const Tensor& weight, int64_t n_groups, float eps, float input_scale) {
  const char* op = "cuda::gated_rms_norm_fp8";
  require_same_dtype(op, {{"y", &y}, {"z", &z}});
  norm::check_q(op, out_q, y, input_scale);
  if (n_groups <= 0 || y.dim(1) % n_groups != 0) {
    throw_runtime(str_cat(op, ": n_groups ", n_groups, " does not divide y ", y.describe()));
  }
  const device::LaunchScope launch_scope(ctx.kernels.pdl);
  const int64_t group_size = y.dim(1) / n_groups;
  const norm::RowNormParams p{out_q.data(),
                              y.data(),
                              z.data(),
                              nullptr,
                              weight.data(),
                              y.dim(0) * n_groups,
                              norm::checked_int(op, "group size", group_size),
                              norm::checked_int(op, "n_groups", n_groups),
                              eps};
  norm::launch_fp8<norm::NormMode::kGated>(p, y.dtype(), weight.dtype(), input_scale, as_stream(ctx.stream), op);
}

}  // namespace chimera::cuda
