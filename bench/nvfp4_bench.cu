// NVFP4 weight-only kernels (docs/nvfp4_cuda.md) at the Nemotron 3 shapes, each beside the bf16 kernel of the same
// shape in the same run:
//   nvfp4_linear_decode_*   T = 1, 2, 4, 8: the automatic GEMV, then both GEMVs forced ("-simt", "-tc"). bytes =
//                           the stored weight (0.5625 B per element: codes + e4m3 block scales) + x + out, so
//                           floor_ratio is the fraction of the copy bandwidth achieved on what must move; beside it
//                           "linear_bf16" (cuda::linear on a bf16 weight: the engine's GEMV or cuBLASLt) on 2 B per
//                           element.
//   nvfp4_linear_prefill_*  T = 512 .. 8192: the dequantizing mma.sync GEMM against cuBLASLt's bf16 GEMM
//                           (cuda::linear), a RATIO line each (nvfp4 time / cuBLASLt time).
//   nvfp4_experts_*         the routed experts (permute + up + down + combine) at decode and prefill token counts,
//                           against the bf16 op (ops::moe_experts) on the same routing; bytes: the touched experts'
//                           stored weights.
// Every case first checks the NVFP4 output against the bf16 kernel's on the dequantized weight (max relative
// difference, a CHECK line): the two compute the same product up to rounding.
// Times: run() (CUDA events around the call, host checks included) and run_graph() (device time per call in a
// CUDA graph, what a captured decode step pays).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/gemm/nvfp4_linear.h"
#include "backends/cuda/moe/nvfp4_experts.h"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "ops/ops.h"

namespace chimera::bench {
namespace {

__device__ __forceinline__ uint32_t hash_u32(uint64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32) * 40503u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h;
}
// Random codes (any byte is two valid E2M1 codes) and e4m3 block scales in [0.5, 1) (bytes 0x30 .. 0x37).
__global__ void fill_codes_kernel(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<uint8_t>(hash_u32(static_cast<uint64_t>(i), seed));
  }
}
__global__ void fill_scales_kernel(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<uint8_t>(0x30u + (hash_u32(static_cast<uint64_t>(i), seed) & 7u));
  }
}
__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t n, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float u = static_cast<float>(hash_u32(static_cast<uint64_t>(i), seed)) * (1.0f / 4294967296.0f) * 2.0f - 1.0f;
    p[i] = __float2bfloat16(u * scale);
  }
}
// The dequantized weight (without weight_scale_2, which the bf16 side applies to x) in bf16: exact.
__global__ void dequant_bf16_kernel(const uint8_t* codes, const uint8_t* scales, __nv_bfloat16* w, int64_t n) {
  constexpr float kValue[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint8_t c = (codes[i / 2] >> (4 * (i % 2))) & 0xfu;
    const uint8_t s = scales[i / 16];
    const float sv = ldexpf(1.0f + static_cast<float>(s & 7u) / 8.0f, static_cast<int>((s >> 3) & 15u) - 7);
    const float v = kValue[c & 7u] * sv;
    w[i] = __float2bfloat16((c & 8u) ? -v : v);
  }
}

Tensor codes_tensor(Shape shape, uint32_t seed) {
  Tensor t = device::empty(Device::kCuda, DType::kU8, std::move(shape));
  fill_codes_kernel<<<1024, 256>>>(t.data_as<uint8_t>(), t.numel(), seed);
  return t;
}
Tensor scales_tensor(Shape shape, uint32_t seed) {
  Tensor t = device::empty(Device::kCuda, DType::kF8E4M3, std::move(shape));
  fill_scales_kernel<<<1024, 256>>>(t.data_as<uint8_t>(), t.numel(), seed);
  return t;
}
Tensor bf16_tensor(Shape shape, float scale, uint32_t seed) {
  Tensor t = device::empty(Device::kCuda, DType::kBF16, std::move(shape));
  fill_bf16_kernel<<<1024, 256>>>(t.data_as<__nv_bfloat16>(), t.numel(), scale, seed);
  return t;
}
Tensor dequantized_bf16(const Tensor& codes, const Tensor& scales, Shape shape) {
  Tensor t = device::empty(Device::kCuda, DType::kBF16, std::move(shape));
  dequant_bf16_kernel<<<4096, 256>>>(codes.data_as<uint8_t>(), scales.data_as<uint8_t>(), t.data_as<__nv_bfloat16>(),
                                     t.numel());
  return t;
}

// max |a - b| / max |b| over two device tensors of one shape.
double rel_diff(const Tensor& a, const Tensor& b) {
  const Tensor ha = device::to_host_f32(a), hb = device::to_host_f32(b);
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < ha.numel(); ++i) {
    num = std::max(num, static_cast<double>(std::fabs(ha.f32()[i] - hb.f32()[i])));
    den = std::max(den, static_cast<double>(std::fabs(hb.f32()[i])));
  }
  return den > 0.0 ? num / den : num;
}

constexpr float kScale2 = 1.0f;  // weight_scale_2 of the bench weights (1: the bf16 weight is the same matrix)

struct LinearCase {
  const char* name;
  int64_t N, K;
};

void bench_linear(const Context& ctx, const LinearCase& lc, std::initializer_list<int64_t> tokens, bool prefill) {
  const ops::Context c{Device::kCuda, nullptr};
  ops::LinearWeight w;
  w.format = ops::WeightFormat::kNvfp4;
  w.name = lc.name;
  w.weight = codes_tensor({lc.N, lc.K / 2}, 3);
  w.weight_scale = scales_tensor({lc.N, lc.K / 16}, 5);
  w.scale = kScale2;
  const Tensor wb = dequantized_bf16(w.weight, w.weight_scale, {lc.N, lc.K});
  for (int64_t T : tokens) {
    const Tensor x = bf16_tensor({T, lc.K}, 1.0f, static_cast<uint32_t>(100 + T));
    Tensor out = device::empty(Device::kCuda, DType::kBF16, {T, lc.N});
    Tensor ref = device::empty(Device::kCuda, DType::kBF16, {T, lc.N});
    const std::string shape = std::string(lc.name) + " N=" + std::to_string(lc.N) + " K=" + std::to_string(lc.K) +
                              " T=" + std::to_string(T) + " x=bf16";
    const double act = static_cast<double>(T) * static_cast<double>(lc.K + lc.N) * 2.0;
    const double nv_bytes = static_cast<double>(lc.N * lc.K) * 0.5625 + act;
    const double bf_bytes = static_cast<double>(lc.N * lc.K) * 2.0 + act;
    const double flops = 2.0 * static_cast<double>(T) * static_cast<double>(lc.N * lc.K);
    cuda::nvfp4_linear(c, out, x, w, Tensor());
    cuda::linear(c, ref, x, wb, Tensor());
    CHIMERA_CUDA_CHECK(cudaDeviceSynchronize(), "bench nvfp4_linear");
    const double d = rel_diff(out, ref);
    std::printf("CHECK nvfp4_linear %s max_rel_diff_vs_bf16=%.3g %s\n", shape.c_str(), d,
                d < 2e-2 ? "ok" : "DIFFERENT");
    std::printf("INFO nvfp4_linear %s floor_us=%.2f (stored bytes / copy bandwidth)\n", shape.c_str(),
                nv_bytes / (kCopyBandwidthGBs * 1e3));
    const double t_nv =
        ctx.run("nvfp4_linear", shape, nv_bytes, flops, [&] { cuda::nvfp4_linear(c, out, x, w, Tensor()); });
    const double g_nv = ctx.run_graph("nvfp4_linear", shape, nv_bytes, flops, [&](cudaStream_t st, int) {
      cuda::nvfp4_linear(ops::Context{Device::kCuda, st}, out, x, w, Tensor());
    });
    if (!prefill) {
      // Both decode GEMVs forced (the automatic choice above is one of them: kNvfp4GemvTensorCores).
      for (const cuda::Nvfp4Path path : {cuda::Nvfp4Path::kGemv, cuda::Nvfp4Path::kGemvTc}) {
        const char* name = path == cuda::Nvfp4Path::kGemv ? "nvfp4_linear-simt" : "nvfp4_linear-tc";
        Tensor o = device::empty(Device::kCuda, DType::kBF16, {T, lc.N});
        cuda::nvfp4_linear_on_path(c, o, x, w, Tensor(), path);
        CHIMERA_CUDA_CHECK(cudaDeviceSynchronize(), "bench nvfp4_linear");
        const double dp = rel_diff(o, ref);
        std::printf("CHECK %s %s max_rel_diff_vs_bf16=%.3g %s\n", name, shape.c_str(), dp,
                    dp < 2e-2 ? "ok" : "DIFFERENT");
        ctx.run_graph(name, shape, nv_bytes, flops, [&](cudaStream_t st, int) {
          cuda::nvfp4_linear_on_path(ops::Context{Device::kCuda, st}, o, x, w, Tensor(), path);
        });
      }
    }
    const double t_bf = ctx.run("linear_bf16", shape, bf_bytes, flops, [&] { cuda::linear(c, ref, x, wb, Tensor()); });
    const double g_bf = ctx.run_graph("linear_bf16", shape, bf_bytes, flops, [&](cudaStream_t st, int) {
      cuda::linear(ops::Context{Device::kCuda, st}, ref, x, wb, Tensor());
    });
    std::printf("RATIO nvfp4_linear/%s %s call=%.3f graph=%.3f\n", prefill ? "cublaslt_bf16" : "linear_bf16",
                shape.c_str(), t_nv / t_bf, g_nv / g_bf);
  }
}

// Nemotron 3 Super: Mamba in_proj [18560, 4096], out_proj [4096, 8192], shared-expert-like [5376, 4096]; Nano
// in_proj [10304, 2688].
constexpr LinearCase kLinearCases[] = {{"super_in_proj", 18560, 4096},
                                       {"super_out_proj", 4096, 8192},
                                       {"super_shared_up", 5376, 4096},
                                       {"nano_in_proj", 10304, 2688}};

CHIMERA_BENCH(nvfp4_linear_decode) {
  for (const LinearCase& lc : kLinearCases) bench_linear(ctx, lc, {1, 2, 4, 8}, false);
}
CHIMERA_BENCH(nvfp4_linear_prefill) {
  for (const LinearCase& lc : kLinearCases) bench_linear(ctx, lc, {512, 2048, 8192}, true);
}

// Routed experts: NVFP4 fused buffers and the same weights dequantized to bf16 (views for ops::moe_experts).
void bench_experts(const Context& ctx, const char* model, int64_t E, int64_t k, int64_t D, int64_t I,
                   std::initializer_list<int64_t> tokens) {
  const ops::Context c{Device::kCuda, nullptr};
  const auto projection = [&](const char* name, int64_t N, int64_t K, uint32_t seed) {
    ops::ExpertWeights w;
    w.format = ops::WeightFormat::kNvfp4;
    w.name = name;
    w.weight = codes_tensor({E, N, K / 2}, seed);
    w.weight_scale = scales_tensor({E, N, K / 16}, seed + 1);
    w.host_scale.assign(static_cast<size_t>(E), kScale2);
    w.scale = device::to_device(Tensor::from_f32({E}, w.host_scale), Device::kCuda);
    return w;
  };
  const ops::ExpertWeights up = projection("experts.up_proj", I, D, 21);
  const ops::ExpertWeights down = projection("experts.down_proj", D, I, 23);
  const Tensor up_bf = dequantized_bf16(up.weight, up.weight_scale, {E, I, D});
  const Tensor down_bf = dequantized_bf16(down.weight, down.weight_scale, {E, D, I});
  std::vector<Tensor> ups, downs;
  for (int64_t e = 0; e < E; ++e) {
    ups.push_back(up_bf.select(e));
    downs.push_back(down_bf.select(e));
  }
  for (int64_t T : tokens) {
    // k distinct experts per token from a hash (uniform routing), weights 1 / k.
    std::vector<int32_t> ids(static_cast<size_t>(T * k));
    for (int64_t t = 0; t < T; ++t) {
      std::set<int32_t> chosen;
      uint64_t h = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(t + 1);
      while (static_cast<int64_t>(chosen.size()) < k) {
        h ^= h >> 29;
        h *= 0xbf58476d1ce4e5b9ull;
        h ^= h >> 32;
        chosen.insert(static_cast<int32_t>(h % static_cast<uint64_t>(E)));
      }
      std::copy(chosen.begin(), chosen.end(), ids.begin() + t * k);
    }
    const std::set<int32_t> touched(ids.begin(), ids.end());
    const Tensor idd = device::to_device(Tensor::from_i32({T, k}, ids), Device::kCuda);
    const Tensor wd = device::to_device(
        Tensor::from_f32({T, k}, std::vector<float>(ids.size(), 1.0f / static_cast<float>(k))), Device::kCuda);
    // x small: relu^2 of the up products of random codes grows fast; this keeps h and out well inside bf16.
    const Tensor x = bf16_tensor({T, D}, 0.05f, static_cast<uint32_t>(300 + T));
    Tensor out = device::empty(Device::kCuda, DType::kBF16, {T, D});
    Tensor ref = device::empty(Device::kCuda, DType::kBF16, {T, D});
    const std::string shape = std::string(model) + " E=" + std::to_string(E) + " k=" + std::to_string(k) +
                              " D=" + std::to_string(D) + " I=" + std::to_string(I) + " T=" + std::to_string(T) +
                              " touched=" + std::to_string(touched.size());
    const double per_expert = 2.0 * static_cast<double>(I * D);
    const double act = 2.0 * static_cast<double>(T * D) * 2.0;
    const double nv_bytes = static_cast<double>(touched.size()) * per_expert * 0.5625 + act;
    const double bf_bytes = static_cast<double>(touched.size()) * per_expert * 2.0 + act;
    const double flops = 2.0 * static_cast<double>(T * k) * per_expert;
    cuda::moe_experts_nvfp4(c, out, x, idd, wd, up, down);
    ops::moe_experts(c, ref, x, idd, wd, ups, downs);
    CHIMERA_CUDA_CHECK(cudaDeviceSynchronize(), "bench nvfp4_experts");
    const double d = rel_diff(out, ref);
    std::printf("CHECK nvfp4_experts %s max_rel_diff_vs_bf16=%.3g %s\n", shape.c_str(), d,
                d < 3e-2 ? "ok" : "DIFFERENT");
    std::printf("INFO nvfp4_experts %s floor_us=%.2f (stored bytes / copy bandwidth)\n", shape.c_str(),
                nv_bytes / (kCopyBandwidthGBs * 1e3));
    const double t_nv = ctx.run("nvfp4_experts", shape, nv_bytes, flops,
                                [&] { cuda::moe_experts_nvfp4(c, out, x, idd, wd, up, down); });
    const double g_nv = ctx.run_graph("nvfp4_experts", shape, nv_bytes, flops, [&](cudaStream_t st, int) {
      cuda::moe_experts_nvfp4(ops::Context{Device::kCuda, st}, out, x, idd, wd, up, down);
    });
    if (T <= 8) {
      for (const cuda::Nvfp4ExpertsPath path : {cuda::Nvfp4ExpertsPath::kGemv, cuda::Nvfp4ExpertsPath::kGemvTc}) {
        const char* name = path == cuda::Nvfp4ExpertsPath::kGemv ? "nvfp4_experts-simt" : "nvfp4_experts-tc";
        Tensor o = device::empty(Device::kCuda, DType::kBF16, {T, D});
        const auto call = [&](cudaStream_t st) {
          cuda::moe_experts_nvfp4_on_path(ops::Context{Device::kCuda, st}, o, x, idd, wd, up, down, path);
        };
        call(nullptr);
        CHIMERA_CUDA_CHECK(cudaDeviceSynchronize(), "bench nvfp4_experts");
        const double dp = rel_diff(o, ref);
        std::printf("CHECK %s %s max_rel_diff_vs_bf16=%.3g %s\n", name, shape.c_str(), dp,
                    dp < 3e-2 ? "ok" : "DIFFERENT");
        ctx.run_graph(name, shape, nv_bytes, flops, [&](cudaStream_t st, int) { call(st); });
      }
    }
    const double t_bf =
        ctx.run("moe_experts_bf16", shape, bf_bytes, flops, [&] { ops::moe_experts(c, ref, x, idd, wd, ups, downs); });
    const double g_bf = ctx.run_graph("moe_experts_bf16", shape, bf_bytes, flops, [&](cudaStream_t st, int) {
      ops::moe_experts(ops::Context{Device::kCuda, st}, ref, x, idd, wd, ups, downs);
    });
    std::printf("RATIO nvfp4_experts/moe_experts_bf16 %s call=%.3f graph=%.3f\n", shape.c_str(), t_nv / t_bf,
                g_nv / g_bf);
  }
}

CHIMERA_BENCH(nvfp4_experts_super) {
  bench_experts(ctx, "super", 512, 22, 1024, 2688, {1, 2, 8, 64, 512, 4096});
}
CHIMERA_BENCH(nvfp4_experts_nano) {
  bench_experts(ctx, "nano", 128, 6, 2688, 1856, {1, 2, 8, 64, 512, 4096});
}

}  // namespace
}  // namespace chimera::bench
