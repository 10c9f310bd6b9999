// FP8 routed-expert benchmarks (cuda::moe_experts_fp8, W8A8 static: ModelOpt's FP8 checkpoints) at the Nemotron 3
// shapes, beside the bf16 experts on the same routing and the same weights (the FP8 ones are the bf16 ones quantized
// per expert, amax / 448).
//
// Floors: decode is bound by the selected experts' weight bytes as stored (1 byte per FP8 weight; 2 for bf16) over
// the 4.2 TB/s copy bandwidth; prefill by the FLOPs (2 GEMMs x 2 x T*k x I x D) over the dense FP8 peak, taken as
// twice the measured bf16 peak (H200: 1979 vs 989 TFLOP/s nominal; measured bf16 790). The BENCH line's floor_ratio
// uses the bf16 ceilings of bench_common.h; the INFO lines print the FP8 floors and the ratios:
//   INFO fp8_moe <shape> floor_us=<weight floor> fp8_us=<graph time> of_floor=<floor / time> bf16_us=<graph time>
//        speedup=<bf16 / fp8>
// CHECK lines: the FP8 output against the bf16 one (relative RMS difference: the quantization error, not a test).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/moe/experts.h"
#include "backends/cuda/moe/fp8_experts.h"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "ops/ops.h"
#include "ops/quant_weights.h"

namespace chimera::bench {
namespace {

constexpr double kFp8PeakTflops = 2.0 * kBf16PeakTflops;

__global__ void fill_uniform_bf16(__nv_bfloat16* p, int64_t n, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32) * 40503u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16((static_cast<float>(h) * (1.0f / 4294967296.0f) * 2.0f - 1.0f) * scale);
  }
}
__global__ void fill_normalish_f32(float* p, int64_t n, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (uint32_t j = 0; j < 4; ++j) {
      uint32_t h = (static_cast<uint32_t>(i) * 4u + j) * 2654435761u ^ seed;
      h ^= h >> 15;
      h *= 2246822519u;
      h ^= h >> 13;
      s += static_cast<float>(h) * (1.0f / 4294967296.0f) - 0.5f;
    }
    p[i] = s * scale * 1.7320508f;
  }
}
// e4m3(w / scale), saturated (the weights are uniform in [-bound, bound], so scale = bound / 448 is amax / 448).
__global__ void quantize_e4m3(const __nv_bfloat16* w, uint8_t* q, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    q[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__bfloat162float(w[i]) / scale, __NV_SATFINITE, __NV_E4M3));
  }
}

Tensor random_bf16(Shape shape, float scale, uint32_t seed) {
  Tensor t = device::empty(Device::kCuda, DType::kBF16, std::move(shape));
  fill_uniform_bf16<<<1024, 256>>>(t.data_as<__nv_bfloat16>(), t.numel(), scale, seed);
  return t;
}
Tensor random_f32(Shape shape, float scale, uint32_t seed) {
  Tensor t = device::empty(Device::kCuda, DType::kF32, std::move(shape));
  fill_normalish_f32<<<1024, 256>>>(t.data_as<float>(), t.numel(), scale, seed);
  return t;
}

ops::ExpertWeights fp8_from(const Tensor& bf16, float bound, float input_scale, const char* name) {
  const int64_t E = bf16.dim(0);
  ops::ExpertWeights w;
  w.format = ops::WeightFormat::kFp8;
  w.act = ops::ActQuant::kStatic;
  w.name = name;
  w.weight = device::empty(Device::kCuda, DType::kF8E4M3, bf16.shape());
  const float s = bound / 448.0f;
  quantize_e4m3<<<1024, 256>>>(bf16.data_as<__nv_bfloat16>(), static_cast<uint8_t*>(w.weight.data()), bf16.numel(), s);
  w.host_scale.assign(static_cast<size_t>(E), s);
  w.host_input_scale.assign(static_cast<size_t>(E), input_scale);
  w.scale = device::to_device(Tensor::from_f32({E}, w.host_scale), Device::kCuda);
  w.input_scale = device::to_device(Tensor::from_f32({E}, w.host_input_scale), Device::kCuda);
  return w;
}

struct Fp8Case {
  const char* model;
  int64_t E, k, D, I;
  float scale;
  Tensor up_bf16, down_bf16, bias;
  std::vector<Tensor> up, down;
  ops::ExpertWeights up8, down8;
  Fp8Case(const char* model_, int64_t E_, int64_t k_, int64_t D_, int64_t I_, float scale_)
      : model(model_), E(E_), k(k_), D(D_), I(I_), scale(scale_) {
    const float bu = 1.7320508f / std::sqrt(static_cast<float>(D)), bd = 1.7320508f / std::sqrt(static_cast<float>(I));
    up_bf16 = random_bf16({E, I, D}, bu, 11);
    down_bf16 = random_bf16({E, D, I}, bd, 13);
    for (int64_t e = 0; e < E; ++e) {
      up.push_back(up_bf16.select(e));
      down.push_back(down_bf16.select(e));
    }
    bias = random_f32({E}, 0.05f, 17);
    // x ~ N(0, 1): amax ~ 4.5; h ~ N(0, 1) (unit-variance weights), relu(h)^2 up to ~20.
    up8 = fp8_from(up_bf16, bu, 4.5f / 448.0f, "experts.{e}.up_proj");
    down8 = fp8_from(down_bf16, bd, 20.0f / 448.0f, "experts.{e}.down_proj");
  }
};

void bench_fp8(const Context& ctx, const Fp8Case& c, std::initializer_list<int64_t> tokens) {
  const char* what = "bench fp8_moe";
  const ops::Context cx{Device::kCuda, nullptr};
  for (int64_t T : tokens) {
    const Tensor logits = random_f32({T, c.E}, 2.0f, static_cast<uint32_t>(100 + T));
    Tensor ids = device::empty(Device::kCuda, DType::kI32, {T, c.k});
    Tensor w = device::empty(Device::kCuda, DType::kF32, {T, c.k});
    ops::router_topk(cx, ids, w, logits, c.bias, {c.k, 1, 1, true, c.scale});
    const Tensor x = device::to_device(device::to_host(random_f32({T, c.D}, 1.0f, static_cast<uint32_t>(200 + T))),
                                       Device::kCuda, DType::kBF16);
    Tensor out8 = device::empty(Device::kCuda, DType::kBF16, {T, c.D});
    Tensor out16 = device::empty(Device::kCuda, DType::kBF16, {T, c.D});
    const Tensor host_ids = device::to_host(ids);
    const size_t touched = std::set<int32_t>(host_ids.i32(), host_ids.i32() + host_ids.numel()).size();
    const double wbytes8 = static_cast<double>(touched) * 2.0 * static_cast<double>(c.I * c.D);
    const double act_bytes = 2.0 * static_cast<double>(T * c.D * 2);
    const double flops = 2.0 * 2.0 * static_cast<double>(T * c.k) * static_cast<double>(c.I * c.D);
    const std::string shape = std::string(c.model) + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) +
                              " D=" + std::to_string(c.D) + " I=" + std::to_string(c.I) + " T=" + std::to_string(T);
    const double floor_us = std::max((wbytes8 + act_bytes) / (kCopyBandwidthGBs * 1e3), flops / (kFp8PeakTflops * 1e6));

    std::vector<std::pair<std::string, cuda::moe::Fp8ExpertsPath>> paths = {{"auto", cuda::moe::Fp8ExpertsPath::kAuto}};
    if (T <= 256) paths.push_back({"gemv", cuda::moe::Fp8ExpertsPath::kGemv});
    if (cuda::moe::cutlass_built() && T >= 64) paths.push_back({"cutlass", cuda::moe::Fp8ExpertsPath::kCutlass});
    double best8 = 0;
    for (const auto& [name, path] : paths) {
      const auto call = [&, path = path](cudaStream_t st) {
        cuda::moe::moe_experts_fp8_on_path(ops::Context{Device::kCuda, st}, out8, x, ids, w, c.up8, c.down8, path);
      };
      call(nullptr);
      const double us = ctx.run_graph(
          "moe_experts_fp8-" + name, shape, wbytes8 + act_bytes, flops, [&](cudaStream_t st, int) { call(st); }, 5);
      CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
      if (name == "auto") best8 = us;
    }
    const double us16 = ctx.run_graph(
        "moe_experts_bf16", shape, 2.0 * wbytes8 + act_bytes, flops,
        [&](cudaStream_t st, int) {
          cuda::moe::moe_experts_on_path(ops::Context{Device::kCuda, st}, out16, x, ids, w, c.up, c.down,
                                         cuda::moe::ExpertsPath::kAuto);
        },
        5);
    CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
    std::printf(
        "INFO fp8_moe %s touched_experts=%zu floor_us=%.2f fp8_us=%.2f of_floor=%.3f bf16_us=%.2f "
        "speedup=%.2f\n",
        shape.c_str(), touched, floor_us, best8, floor_us / best8, us16, us16 / best8);
    cuda::moe_experts_fp8(cx, out8, x, ids, w, c.up8, c.down8);
    cuda::moe::moe_experts_on_path(cx, out16, x, ids, w, c.up, c.down, cuda::moe::ExpertsPath::kAuto);
    const Tensor a = device::to_host_f32(out8), b = device::to_host_f32(out16);
    double num = 0, den = 0;
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double d = static_cast<double>(a.f32()[i]) - b.f32()[i];
      num += d * d;
      den += static_cast<double>(b.f32()[i]) * b.f32()[i];
    }
    std::printf("CHECK fp8_moe %s fp8-vs-bf16 rel_rms=%.4f\n", shape.c_str(), std::sqrt(num / std::max(den, 1e-30)));
  }
}

CHIMERA_BENCH(moe_experts_fp8_nano) {
  const Fp8Case c("nano", 128, 6, 2688, 1856, 2.5f);
  bench_fp8(ctx, c, {1, 2, 4, 8, 64, 1024, 4096, 8192});
}
// Super's routed experts run on the latent (1024) with intermediate 2688.
CHIMERA_BENCH(moe_experts_fp8_super) {
  const Fp8Case c("super", 512, 22, 1024, 2688, 5.0f);
  bench_fp8(ctx, c, {1, 2, 4, 8, 64, 1024, 4096});
}

}  // namespace
}  // namespace chimera::bench
