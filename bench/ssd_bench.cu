// SSD chunked-scan prefill (ops::ssd_chunk_scan) at Nemotron 3 Nano (H = 64) and Super (H = 128) shapes:
// P = 64, N = 128, G = 8, chunk 128, bf16 activations, fp32 state, one sequence of 1K / 8K / 32K tokens
// (plus a packed batch). The whole op is timed: host plan + upload, the five launches.
//
// FLOPs are the useful FLOPs of the chunked algorithm as mamba_ssm computes it (full chunk tiles), per chunk:
//   H * (2 Q P N [chunk state] + 2 Q P N [C . S_in] + 2 Q Q P [(C.B * L) . x]) + G * 2 Q Q N [C . B]
// (~213 GFLOP at 32K tokens with 128 heads). Bytes: x, dt, B, C read, y written, the state read
// and written once. The peer numbers come from bench/peers/ssd_peers.py with the same shape text.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/mamba/ssd_kernels.cuh"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "ops/ops.h"

namespace chimera::bench {
namespace {

constexpr int64_t kP = 64, kN = 128, kG = 8, kChunk = 128;

// Uniform values in [lo, hi) from a counter hash (no host RNG for hundreds of millions of elements).
template <typename T>
__global__ void fill_uniform_kernel(T* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    const float u = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    p[i] = cuda::from_float<T>(lo + (hi - lo) * u);
  }
}

Tensor uniform(DType dtype, Shape shape, uint32_t seed, float lo, float hi) {
  Tensor t = device::empty(Device::kCuda, dtype, std::move(shape));
  const size_t n = static_cast<size_t>(t.numel());
  if (dtype == DType::kBF16) {
    fill_uniform_kernel<<<1024, 256>>>(t.data_as<__nv_bfloat16>(), n, seed, lo, hi);
  } else {
    fill_uniform_kernel<<<1024, 256>>>(t.data_as<float>(), n, seed, lo, hi);
  }
  device::synchronize(Device::kCuda);
  return t;
}

// One prefill problem: S sequences packed back to back, bf16 activations, fp32 state, random inputs.
struct Problem {
  std::vector<int32_t> cu = {0}, slots;
  int64_t T = 0, H = 0, S = 0;
  Tensor x, dt, B, C, y, state;
  ops::SsmParams p;
  double flops = 0.0, bytes = 0.0;
  std::string shape;

  Problem(int64_t heads, const std::vector<int32_t>& lens) : H(heads) {
    for (int32_t n : lens) {
      cu.push_back(cu.back() + n);
      slots.push_back(static_cast<int32_t>(slots.size()));
    }
    T = cu.back();
    S = static_cast<int64_t>(lens.size());
    x = uniform(DType::kBF16, {T, H, kP}, 1, -1.0f, 1.0f);
    dt = uniform(DType::kBF16, {T, H}, 2, -1.0f, 1.0f);
    B = uniform(DType::kBF16, {T, kG, kN}, 3, -0.5f, 0.5f);
    C = uniform(DType::kBF16, {T, kG, kN}, 4, -0.5f, 0.5f);
    y = device::empty(Device::kCuda, DType::kBF16, {T, H, kP});
    state = uniform(DType::kF32, {S, H, kP, kN}, 5, -0.5f, 0.5f);
    p.A_log = uniform(DType::kF32, {H}, 6, 0.0f, 2.5f);
    p.D = uniform(DType::kF32, {H}, 7, -1.0f, 1.0f);
    p.dt_bias = uniform(DType::kF32, {H}, 8, -4.0f, -1.0f);
    for (int32_t n : lens) {
      const double chunks = static_cast<double>((n + kChunk - 1) / kChunk), Q = kChunk;
      flops += chunks * (static_cast<double>(H) * (4.0 * Q * kP * kN + 2.0 * Q * Q * kP) + kG * 2.0 * Q * Q * kN);
    }
    bytes = 2.0 * (2.0 * T * H * kP + T * H + 2.0 * T * kG * kN) + 2.0 * 4.0 * S * H * kP * kN;
    shape = "T=" + std::to_string(T) + " H=" + std::to_string(H) + " P=64 N=128 G=8 Q=128 bf16";
    if (S > 1) shape = "seqs=" + std::to_string(S) + "x" + std::to_string(lens[0]) + " " + shape;
  }
  cuda::SsdRunner runner(const cuda::SsdOptions& o) const {
    return cuda::SsdRunner(y, x, dt, B, C, p, state, cu, slots, kChunk, nullptr, o);
  }
};

void prefill(const Context& ctx, const char* model, int64_t H, const std::vector<int32_t>& lens) {
  const Problem pr(H, lens);
  const ops::Context octx{Device::kCuda, nullptr};
  ctx.run(std::string("ssd_chunk_scan-") + model, pr.shape, pr.bytes, pr.flops, [&] {
    ops::ssd_chunk_scan(octx, pr.y, pr.x, pr.dt, pr.B, pr.C, pr.p, pr.state, pr.cu, pr.slots, kChunk);
  });
}

std::string describe(const cuda::SsdOptions& o, const cuda::SsdRunner& r) {
  if (o.portable) return "portable";
  return "M=" + (o.superchunk ? std::to_string(o.superchunk) : "auto(" + std::to_string(r.superchunk()) + ")");
}

// Where the time goes: each stage alone, for the default kernels at the automatic superchunk length and at
// superchunks of 4, 8, 16, 32 chunks. Stage FLOPs: chunk_state 2 Q P N per chunk and head; chunk_scan the rest
// plus the state steps it repeats inside superchunks ((M - 1) / M of chunk_state's). Stage bytes: what the stage
// must move at least.
const cuda::SsdOptions kStageVariants[] = {{}, {.superchunk = 4}, {.superchunk = 8}, {.superchunk = 16},
                                           {.superchunk = 32}};
const cuda::SsdOptions kDefaultOnly[] = {{}};

void stages(const Context& ctx, const char* model, int64_t H, int32_t T, std::span<const cuda::SsdOptions> variants) {
  const Problem pr(H, {T});
  const double chunks = static_cast<double>((T + kChunk - 1) / kChunk), Q = kChunk;
  const double state_flops = chunks * H * 2.0 * Q * kP * kN;
  for (const cuda::SsdOptions& o : variants) {
    const cuda::SsdRunner r = pr.runner(o);
    const std::string shape = pr.shape + " " + describe(o, r);
    const double supers = std::ceil(chunks / r.superchunk());
    const double state_bytes = supers * H * kP * kN * 4.0;
    const std::string k = std::string("ssd_stage-") + model;
    r.prepare();
    ctx.run(k + "-cumsum", shape, T * H * (2.0 + 8.0), 0.0, [&] { r.chunk_cumsum(); });
    ctx.run(k + "-chunk_state", shape, 2.0 * T * (H * kP + kG * kN) + state_bytes, state_flops,
            [&] { r.chunk_state(); });
    ctx.run(k + "-state_passing", shape, 3.0 * state_bytes, 0.0, [&] { r.state_passing(); });
    ctx.run(k + "-chunk_scan", shape, 2.0 * T * (2.0 * H * kP + 2.0 * kG * kN) + state_bytes,
            pr.flops - state_flops * (1.0 / r.superchunk()), [&] { r.chunk_scan(); });
    ctx.run(k + "-all", shape, pr.bytes, pr.flops, [&] { r.run(); });
  }
}

// The whole op (host plan included, as ops::ssd_chunk_scan) at the automatic superchunk length and at 8 and 16.
void prefill_variants(const Context& ctx, const char* model, int64_t H, const std::vector<int32_t>& lens) {
  const Problem pr(H, lens);
  for (const cuda::SsdOptions& o : {cuda::SsdOptions{}, cuda::SsdOptions{.superchunk = 8},
                                    cuda::SsdOptions{.superchunk = 16}}) {
    const std::string shape = pr.shape + " " + describe(o, pr.runner(o));
    ctx.run(std::string("ssd_variant-") + model, shape, pr.bytes, pr.flops, [&] { pr.runner(o).run(); });
  }
}

// The default kernels against another variant on the same inputs and initial state, at a model shape the
// tests do not reach: normalised MSE of y and of the final state, and the largest |dy|.
void cross_check(const char* model, int64_t H, int32_t T, const cuda::SsdOptions& other) {
  const Problem pr(H, {T});
  const Tensor state0 = device::empty(Device::kCuda, DType::kF32, pr.state.shape());
  device::copy(state0, pr.state);
  const cuda::SsdOptions def;
  pr.runner(def).run();
  const Tensor ya = device::to_host_f32(pr.y), sa = device::to_host_f32(pr.state);
  device::copy(pr.state, state0);
  const cuda::SsdRunner r = pr.runner(other);
  r.run();
  const Tensor yb = device::to_host_f32(pr.y), sb = device::to_host_f32(pr.state);
  auto nmse = [](const Tensor& a, const Tensor& b, double* max_abs) {
    double num = 0.0, den = 0.0, mx = 0.0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double d = static_cast<double>(a.f32()[i]) - b.f32()[i];
      num += d * d;
      den += static_cast<double>(b.f32()[i]) * b.f32()[i];
      mx = std::max(mx, std::fabs(d));
    }
    if (max_abs) *max_abs = mx;
    return num / std::max(den, 1e-30);
  };
  double max_abs = 0.0;
  const double ny = nmse(ya, yb, &max_abs), ns = nmse(sa, sb, nullptr);
  std::printf("CHECK kernel=ssd_chunk_scan-%s shape=%s default_vs=\"%s\" nmse_y=%.3g max_abs_dy=%.3g nmse_state=%.3g %s\n",
              model, pr.shape.c_str(), describe(other, r).c_str(), ny, max_abs, ns,
              ny < 1e-4 && ns < 1e-4 ? "ok" : "MISMATCH");
  std::fflush(stdout);
}

// Prefix caching's cost in the scan (ops::ssd_chunk_scan, host plan included): one prompt of T tokens with a state
// checkpoint every `spacing` tokens (none: 0). Each cut restarts the chunk grid and writes a state of its own, so
// the bytes are the plain call's plus one state per checkpoint; the FLOPs are the plain call's (the cuts fall on
// chunk boundaries here).
void prefill_checkpoints(const Context& ctx, const char* model, int64_t H, int32_t T, int32_t spacing) {
  const std::vector<ops::StateCheckpoint> cuts = checkpoints_every(T, spacing);
  const int64_t n_cuts = static_cast<int64_t>(cuts.size());
  const Problem pr(H, {T});
  // The problem's one slot, then one slot per checkpoint.
  const Tensor state = uniform(DType::kF32, {1 + n_cuts, H, kP, kN}, 5, -0.5f, 0.5f);
  const double bytes = pr.bytes + static_cast<double>(n_cuts) * H * kP * kN * 4.0;
  const std::string shape =
      pr.shape + " checkpoints=" + std::to_string(n_cuts) + (spacing > 0 ? " every=" + std::to_string(spacing) : "");
  const ops::Context octx{Device::kCuda, nullptr};
  ctx.run(std::string("ssd_chunk_scan_checkpoints-") + model, shape, bytes, pr.flops, [&] {
    ops::ssd_chunk_scan(octx, pr.y, pr.x, pr.dt, pr.B, pr.C, pr.p, state, pr.cu, pr.slots, kChunk, cuts);
  });
}

}  // namespace

CHIMERA_BENCH(ssd_prefill_nano) {
  for (int32_t T : {1024, 8192, 32768}) prefill(ctx, "nano", 64, {T});
}

CHIMERA_BENCH(ssd_prefill_super) {
  for (int32_t T : {1024, 8192, 32768}) prefill(ctx, "super", 128, {T});
}

// A packed batch: 16 prompts of 512 tokens, Super heads.
CHIMERA_BENCH(ssd_prefill_super_batch) { prefill(ctx, "super", 128, std::vector<int32_t>(16, 512)); }

CHIMERA_BENCH(ssd_stages) {
  stages(ctx, "super", 128, 32768, kStageVariants);
  stages(ctx, "nano", 64, 8192, kStageVariants);
  stages(ctx, "nano", 64, 32768, kDefaultOnly);
}

CHIMERA_BENCH(ssd_prefill_variants) {
  for (int32_t T : {1024, 8192, 32768}) prefill_variants(ctx, "nano", 64, {T});
  for (int32_t T : {1024, 8192, 32768}) prefill_variants(ctx, "super", 128, {T});
  prefill_variants(ctx, "super", 128, std::vector<int32_t>(16, 512));
}

CHIMERA_BENCH(ssd_cross_check) {
  (void)ctx;
  cross_check("nano", 64, 8192, {.portable = true});  // the portable fp32 kernels
  cross_check("super", 128, 32768, {.superchunk = 16});
  cross_check("super", 128, 8192, {.superchunk = 3});
}

// 8K tokens at Nano and Super heads: none, every 2048 (the default spacing), every 512.
CHIMERA_BENCH(ssd_prefill_checkpoints) {
  for (int32_t spacing : {0, 2048, 512}) prefill_checkpoints(ctx, "nano", 64, 8192, spacing);
  for (int32_t spacing : {0, 2048, 512}) prefill_checkpoints(ctx, "super", 128, 8192, spacing);
}

}  // namespace chimera::bench
