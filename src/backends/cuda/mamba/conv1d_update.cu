// causal_conv1d_update: one new token per slot (decode), conv1d.cuh for the math.
//   x, out [batch, C] act dtype; conv_state [num_slots, C, K-1] state dtype, shifted left by one in place (or into
//   slot dst_slots[b]: Conv1dParams::dst_slots).
// Fast kernel: a thread per (R = 1 row, E = 16 / sizeof(act) channels). The taps
// go out first, once for all R rows (16-byte vectors when they are in the activation dtype; constant weights,
// so under PDL they load while the previous kernel drains), then the R slot ids and the R 16-byte x loads (x
// does not depend on the slot), then the E * (K-1) state elements of each row (contiguous: 16- or 8-byte
// accesses). The FMA order is the prefill kernel's, so a one-token prefill and the update agree bit for bit.
// Portable kernel (unaligned views, C not a multiple of E): a thread per element.
#include "backends/cuda/mamba/conv1d.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mamba/mamba_common.cuh"

namespace chimera::cuda {
namespace conv_update {

using cuda::load_elem;
using mamba::load_param;
using mamba::Pack;
using mamba::silu_fast;
using mamba::store_elem;

constexpr int kThreads = 128;

// Rows per thread R: 1. At decode sizes more, smaller blocks (one row, 128 threads) keep more state loads in flight
// than loading each tap vector once for several rows; the kernel keeps R as a template parameter (same math per row).

// grid (ceil(C / (E * kThreads)), ceil(batch / R)), kThreads threads.
template <typename T, typename S, int K, int R>
__global__ void __launch_bounds__(kThreads) causal_conv1d_update_kernel(const Conv1dParams p) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  const int64_t C = p.C;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * E;
  if (c0 >= C) return;  // touches nothing; thread 0 of every block stays, so each block waits below
  float w[E][K], bias[E];
  mamba::load_taps<T, E, K>(p.weight, p.weight_dtype, p.bias, p.bias_dtype, p.taps_vec, c0, w, bias);
  const int b0 = blockIdx.y * R;
  int slot[R], dst[R];  // step metadata, written by no kernel of the step (Conv1dParams::slots): read before the wait
#pragma unroll
  for (int r = 0; r < R; ++r) {
    slot[r] = b0 + r < p.batch ? p.slots[b0 + r] : -1;
    dst[r] = slot[r] >= 0 && p.dst_slots != nullptr ? p.dst_slots[b0 + r] : slot[r];
  }
  pdl_wait();  // PDL: x and conv_state are step data (earlier kernels' outputs)
  pdl_trigger();
  Pack<T, E> xv[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const bool row = b0 + r < p.batch;
    if (row) {
      xv[r].load(static_cast<const T*>(p.x) + (b0 + r) * C + c0);
    } else {
      xv[r].zero();
    }
  }
  Pack<S, E*(K - 1)> st[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (slot[r] >= 0) {
      st[r].load(static_cast<const S*>(p.conv_state) + (slot[r] * C + c0) * (K - 1));
    } else {
      st[r].zero();
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (slot[r] < 0) continue;  // pad (or past the batch): row and state untouched
    Pack<S, E*(K - 1)> next;
    next.zero();
    Pack<T, E> o;
    o.zero();
#pragma unroll
    for (int e = 0; e < E; ++e) {
      float acc = bias[e];
#pragma unroll
      for (int j = 0; j < K - 1; ++j) acc = __fmaf_rn(w[e][j], st[r].get(e * (K - 1) + j), acc);
      acc = __fmaf_rn(w[e][K - 1], xv[r].get(e), acc);
      o.set(e, p.silu ? silu_fast(acc) : acc);
#pragma unroll
      for (int j = 0; j + 1 < K - 1; ++j) next.set(e * (K - 1) + j, st[r].get(e * (K - 1) + j + 1));
      next.set(e * (K - 1) + K - 2, xv[r].get(e));
    }
    next.store(static_cast<S*>(p.conv_state) + (dst[r] * C + c0) * (K - 1));
    o.store(static_cast<T*>(p.out) + (b0 + r) * C + c0);
  }
}

// grid (ceil(C / kThreads), batch); every access element-wise in its runtime dtype.
template <int K>
__global__ void __launch_bounds__(kThreads) causal_conv1d_update_portable_kernel(const Conv1dParams p) {
  const int b = blockIdx.y;
  pdl_wait();  // PDL: slots, x and conv_state are step data
  pdl_trigger();
  const int slot = p.slots[b];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (slot < 0 || c >= p.C) return;
  const float xn = load_elem(p.x, p.act, b * p.C + c);
  const int64_t s0 = (slot * p.C + c) * (K - 1);
  const int64_t d0 = (static_cast<int64_t>(p.dst_slots != nullptr ? p.dst_slots[b] : slot) * p.C + c) * (K - 1);
  float st[K - 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) st[j] = load_elem(p.conv_state, p.state_dtype, s0 + j);
  float acc = p.bias != nullptr ? load_param(p.bias, p.bias_dtype, c) : 0.0f;
#pragma unroll
  for (int j = 0; j < K - 1; ++j) acc = __fmaf_rn(load_param(p.weight, p.weight_dtype, c * K + j), st[j], acc);
  acc = __fmaf_rn(load_param(p.weight, p.weight_dtype, c * K + K - 1), xn, acc);
#pragma unroll
  for (int j = 0; j + 1 < K - 1; ++j) store_elem(p.conv_state, p.state_dtype, d0 + j, st[j + 1]);
  store_elem(p.conv_state, p.state_dtype, d0 + K - 2, xn);
  store_elem(p.out, p.act, b * p.C + c, p.silu ? silu_fast(acc) : acc);
}

template <int K>
void launch_k(const Conv1dParams& p, cudaStream_t stream) {
  CHIMERA_DISPATCH_FLOAT(p.act, "ops::causal_conv1d_update x", T, {
    constexpr int E = 16 / static_cast<int>(sizeof(T));
    const bool vec = mamba::aligned16(p.x) && mamba::aligned16(p.out) && mamba::aligned16(p.conv_state) &&
                     p.C % E == 0;
    if (vec) {
      Conv1dParams q = p;
      q.taps_vec = mamba::aligned16(p.weight) && p.weight_dtype == p.act &&
                   (p.bias == nullptr || (mamba::aligned16(p.bias) && p.bias_dtype == p.act));
      CHIMERA_DISPATCH_FLOAT(p.state_dtype, "ops::causal_conv1d_update conv_state", S, {
        const int64_t chan_blocks = ceil_div(p.C, E * kThreads);
        const dim3 grid(static_cast<unsigned>(chan_blocks), static_cast<unsigned>(p.batch));
        launch(causal_conv1d_update_kernel<T, S, K, 1>, grid, dim3(kThreads), 0, stream, q);
      });
    } else {
      const dim3 grid(static_cast<unsigned>(ceil_div(p.C, kThreads)), static_cast<unsigned>(p.batch));
      launch(causal_conv1d_update_portable_kernel<K>, grid, dim3(kThreads), 0, stream, p);
    }
  });
}

}  // namespace conv_update

void launch_causal_conv1d_update(const Conv1dParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.C == 0) return;
  if (p.batch > 65535) throw_runtime(str_cat("ops::causal_conv1d_update: batch ", p.batch, " exceeds 65535"));
  switch (p.K) {
    case 2:
      conv_update::launch_k<2>(p, stream);
      break;
    case 3:
      conv_update::launch_k<3>(p, stream);
      break;
    case 4:
      conv_update::launch_k<4>(p, stream);
      break;
    default:
      throw_runtime(str_cat("ops::causal_conv1d_update: conv_kernel ", p.K, " is not supported on CUDA (2, 3, 4)"));
  }
  CHIMERA_LAUNCH_CHECK("ops::causal_conv1d_update");
}

}  // namespace chimera::cuda
