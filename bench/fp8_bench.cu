// Benchmarks of the FP8 kernels (backends/cuda/gemm/fp8_linear.h) at Nemotron 3 Nano / Super shapes (docs/model.md
// 9: Nano hidden 2688, Mamba in_proj 2688 -> 10304, out_proj 4096 -> 2688, shared expert 2688 <-> 3712, attention
// q 2688 -> 4096, k / v 2688 -> 256, o 4096 -> 2688; Super hidden 4096, in_proj 4096 -> 18560, out_proj 8192 -> 4096,
// latent 4096 -> 1024), each against its floor, beside the bf16 layer it replaces; bench/peers/fp8_peers.py times
// torch._scaled_mm on the same shapes and bench/peers/fp8_compare.py joins the two logs.
//
//   fp8_linear_decode   T = 1, 2, 4, 8: the CUDA-core GEMV (W8A8 with x quantized in its prologue, prequantized x,
//                       weight-only), the tensor-core GEMV (W8A8, prequantized), fp8_linear's own choice, and the
//                       bf16 plan (ops::linear), device time per call in a CUDA graph.
//                       Floor: bytes / 4.2 TB/s, bytes = N K (e4m3 weight) + 2 T K (bf16 x) + 2 T N (bf16 y).
//   fp8_linear_prefill  T = 512, 1024, 4096, 8192: cuBLASLt's FP8 GEMM on a prequantized x (fast accumulation off,
//                       the engine's setting, and on), quantize_fp8 + GEMM (fp8_linear), and the bf16 cuBLASLt GEMM.
//                       Besides the harness's line, an "FP8" line with TFLOP/s over kFp8PeakTflops.
//   fp8_norm            add_rms_norm_fp8 and gated_rms_norm_fp8 against the unfused pair (the norm, then
//                       quantize_fp8), and quantize_fp8 alone; bytes as moved by the fused kernel.
// Buffers rotate so that a case's working set (>= 256 MiB when it can) is not served from L2 between calls.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/gemm/fp8_linear.h"
#include "backends/cuda/gemm/fp8_quant.cuh"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "ops/ops.h"
#include "ops/quant_norm_ops.h"

namespace chimera::bench {
namespace {

// Hopper's dense FP8 tensor-core rate is twice its bf16 rate: twice the measured bf16 ceiling (not a measured
// FP8 figure).
constexpr double kFp8PeakTflops = 2.0 * kBf16PeakTflops;
constexpr double kRotateBytes = 256.0 * (1 << 20);

__device__ __forceinline__ float hash_uniform(int64_t i, uint64_t seed) {
  uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ull ^ seed;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
}

template <typename T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = cuda::from_float<T>(lo + (hi - lo) * hash_uniform(i, seed));
  }
}

// e4m3 codes of uniform values in [-224, 224) (never NaN).
__global__ void fill_e4m3_kernel(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p[i] = static_cast<uint8_t>(cuda::fp8::encode2(448.0f * (hash_uniform(i, seed) - 0.5f), 0.0f) & 0xffu);
  }
}

uint64_t next_seed() {
  static uint64_t seed = 7;
  return ++seed * 0x2545f4914f6cdd1dull;
}

Tensor random(DType dtype, Shape shape, float lo = -1.0f, float hi = 1.0f) {
  Tensor t = device::empty(Device::kCuda, dtype, std::move(shape));
  const int64_t n = t.numel();
  const int blocks = static_cast<int>(std::min<int64_t>(4096, (n + 255) / 256));
  if (n == 0) return t;
  if (dtype == DType::kF8E4M3) {
    fill_e4m3_kernel<<<blocks, 256>>>(static_cast<uint8_t*>(t.data()), n, next_seed());
    return t;
  }
  CHIMERA_DISPATCH_FLOAT(dtype, "bench fill", T,
                         { fill_kernel<T><<<blocks, 256>>>(t.data_as<T>(), n, next_seed(), lo, hi); });
  return t;
}

int rotations(double bytes) {
  return static_cast<int>(std::clamp(kRotateBytes / std::max(bytes, 1.0), 1.0, 8.0));
}

struct Proj {
  const char* name;
  int64_t in, out;
};

const Proj kDecodeProjs[] = {{"nano_in_proj", 2688, 10304},  {"nano_out_proj", 4096, 2688},
                             {"nano_shared_up", 2688, 3712}, {"nano_shared_down", 3712, 2688},
                             {"nano_q_proj", 2688, 4096},    {"nano_kv_proj", 2688, 256},
                             {"nano_o_proj", 4096, 2688},    {"super_in_proj", 4096, 18560},
                             {"super_out_proj", 8192, 4096}, {"super_latent_in", 4096, 1024}};
const Proj kPrefillProjs[] = {{"nano_in_proj", 2688, 10304},  {"nano_out_proj", 4096, 2688},
                              {"nano_shared_up", 2688, 3712}, {"nano_q_proj", 2688, 4096},
                              {"super_in_proj", 4096, 18560}, {"super_out_proj", 8192, 4096}};

std::string shape_text(const Proj& p, int64_t T) {
  return "T=" + std::to_string(T) + " in=" + std::to_string(p.in) + " out=" + std::to_string(p.out) + " bf16 (" +
         p.name + ")";
}

// One rotated buffer set of an FP8 layer: the weight, x (bf16), xq (e4m3), y (bf16), and the bf16 weight of the
// same shape for the dense comparison.
struct Set {
  ops::LinearWeight w;
  Tensor x, xq, y, w16;
};

std::vector<Set> sets_for(const Proj& p, int64_t T, double bytes, bool dense) {
  std::vector<Set> sets;
  for (int i = 0; i < rotations(bytes); ++i) {
    Set s;
    s.w.format = ops::WeightFormat::kFp8;
    s.w.act = ops::ActQuant::kStatic;
    s.w.name = p.name;
    s.w.weight = random(DType::kF8E4M3, {p.out, p.in});
    s.w.scale = 1.0f / (224.0f * std::sqrt(static_cast<float>(p.in)));
    s.w.input_scale = 1.0f / 224.0f;
    s.x = random(DType::kBF16, {T, p.in});
    s.xq = random(DType::kF8E4M3, {T, p.in});
    s.y = random(DType::kBF16, {T, p.out});
    if (dense) {
      const float ws = 1.0f / std::sqrt(static_cast<float>(p.in));
      s.w16 = random(DType::kBF16, {p.out, p.in}, -ws, ws);
    }
    sets.push_back(std::move(s));
  }
  return sets;
}

void fp8_line(const std::string& kernel, const std::string& shape, double us, double flops) {
  const double tflops = flops / (us * 1e-6) / 1e12;
  std::printf("FP8 kernel=%s shape=%s us=%.2f tflops=%.1f fp8_peak_ratio=%.3f\n", kernel.c_str(), shape.c_str(), us,
              tflops, tflops / kFp8PeakTflops);
  std::fflush(stdout);
}

CHIMERA_BENCH(fp8_linear_decode) {
  for (const Proj& p : kDecodeProjs) {
    for (int64_t T : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}}) {
      const double bytes = 1.0 * p.out * p.in + 2.0 * T * p.in + 2.0 * T * p.out;
      const double flops = 2.0 * T * p.in * p.out;
      const std::vector<Set> sets = sets_for(p, T, bytes, true);
      const std::string shape = shape_text(p, T);
      const auto at = [&](int i) -> const Set& { return sets[static_cast<size_t>(i) % sets.size()]; };
      ctx.run_graph("fp8_gemv_w8a8", shape, bytes, flops, [&](cudaStream_t st, int i) {
        cuda::fp8_linear_with_path(ops::Context{Device::kCuda, st}, at(i).y, at(i).x, at(i).w, Tensor(),
                                   cuda::Fp8LinearPath::kGemv);
      });
      ctx.run_graph("fp8_gemv_mma_w8a8", shape, bytes, flops, [&](cudaStream_t st, int i) {
        cuda::fp8_linear_with_path(ops::Context{Device::kCuda, st}, at(i).y, at(i).x, at(i).w, Tensor(),
                                   cuda::Fp8LinearPath::kGemvMma);
      });
      ctx.run_graph("fp8_gemv_prequant", shape, bytes - 1.0 * T * p.in, flops, [&](cudaStream_t st, int i) {
        cuda::fp8_linear_prequant_with_path(ops::Context{Device::kCuda, st}, at(i).y, at(i).xq, at(i).w, Tensor(),
                                            cuda::Fp8LinearPath::kGemv);
      });
      ctx.run_graph("fp8_gemv_mma_prequant", shape, bytes - 1.0 * T * p.in, flops, [&](cudaStream_t st, int i) {
        cuda::fp8_linear_prequant_with_path(ops::Context{Device::kCuda, st}, at(i).y, at(i).xq, at(i).w, Tensor(),
                                            cuda::Fp8LinearPath::kGemvMma);
      });
      ctx.run_graph("fp8_linear_plan", shape, bytes, flops, [&](cudaStream_t st, int i) {
        cuda::fp8_linear(ops::Context{Device::kCuda, st}, at(i).y, at(i).x, at(i).w, Tensor());
      });
      ctx.run_graph("fp8_gemv_weight_only", shape, bytes, flops, [&](cudaStream_t st, int i) {
        ops::LinearWeight w = at(i).w;
        w.act = ops::ActQuant::kNone;
        cuda::fp8_linear_with_path(ops::Context{Device::kCuda, st}, at(i).y, at(i).x, w, Tensor(),
                                   cuda::Fp8LinearPath::kGemv);
      });
      const double bytes16 = bytes + 1.0 * p.out * p.in;
      ctx.run_graph("linear_bf16_plan", shape, bytes16, flops, [&](cudaStream_t st, int i) {
        ops::linear(ops::Context{Device::kCuda, st}, at(i).y, at(i).x, at(i).w16);
      });
    }
  }
}

CHIMERA_BENCH(fp8_linear_prefill) {
  const ops::Context c{Device::kCuda, nullptr};
  for (const Proj& p : kPrefillProjs) {
    for (int64_t T : {int64_t{512}, int64_t{1024}, int64_t{4096}, int64_t{8192}}) {
      const double bytes = 1.0 * p.out * p.in + 1.0 * T * p.in + 2.0 * T * p.out;
      const double flops = 2.0 * T * p.in * p.out;
      const std::vector<Set> sets = sets_for(p, T, bytes, true);
      const std::string shape = shape_text(p, T);
      size_t k = 0;
      for (const bool fast : {false, true}) {
        const std::string name = fast ? "fp8_gemm_prequant-fastacc" : "fp8_gemm_prequant";
        const double us = ctx.run(name, shape, bytes, flops, [&] {
          const Set& s = sets[k++ % sets.size()];
          cuda::fp8_linear_prequant_with_path(c, s.y, s.xq, s.w, Tensor(), cuda::Fp8LinearPath::kGemm, fast);
        });
        fp8_line(name, shape, us, flops);
      }
      const double us = ctx.run("fp8_linear", shape, bytes + 2.0 * T * p.in, flops, [&] {
        const Set& s = sets[k++ % sets.size()];
        cuda::fp8_linear(c, s.y, s.x, s.w, Tensor());  // quantize_fp8 + the GEMM
      });
      fp8_line("fp8_linear", shape, us, flops);
      ctx.run("linear_bf16", shape, bytes + 1.0 * p.out * p.in + 1.0 * T * p.in, flops, [&] {
        const Set& s = sets[k++ % sets.size()];
        ops::linear(c, s.y, s.x, s.w16);
      });
    }
  }
}

CHIMERA_BENCH(fp8_norm) {
  const float s = 1.0f / 64.0f;
  for (int64_t D : {int64_t{2688}, int64_t{4096}}) {
    const Tensor w = random(DType::kBF16, {D}, 0.5f, 1.5f);
    for (int64_t T : {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{1024}, int64_t{8192}}) {
      // fused: read x, residual; write residual (bf16) and out_q (e4m3)
      const double bytes = 2.0 * T * D * 3 + 1.0 * T * D + 2.0 * D;
      struct Sets {
        Tensor x, res, q, normed;
      };
      std::vector<Sets> sets;
      for (int i = 0; i < rotations(bytes); ++i) {
        sets.push_back({random(DType::kBF16, {T, D}), random(DType::kBF16, {T, D}), random(DType::kF8E4M3, {T, D}),
                        random(DType::kBF16, {T, D})});
      }
      const auto at = [&](int i) -> const Sets& { return sets[static_cast<size_t>(i) % sets.size()]; };
      const std::string shape = "T=" + std::to_string(T) + " D=" + std::to_string(D) + " bf16";
      ctx.run_graph("add_rms_norm_fp8", shape, bytes, 0, [&](cudaStream_t st, int i) {
        ops::add_rms_norm_fp8(ops::Context{Device::kCuda, st}, at(i).res, at(i).q, at(i).x, w, 1e-5f, s);
      });
      ctx.run_graph("add_rms_norm+quantize_fp8", shape, bytes, 0, [&](cudaStream_t st, int i) {
        const ops::Context cs{Device::kCuda, st};
        ops::add_rms_norm(cs, at(i).res, at(i).normed, at(i).x, w, 1e-5f);
        ops::quantize_fp8(cs, at(i).q, at(i).normed, s);
      });
      ctx.run_graph("quantize_fp8", shape, 3.0 * T * D, 0, [&](cudaStream_t st, int i) {
        ops::quantize_fp8(ops::Context{Device::kCuda, st}, at(i).q, at(i).x, s);
      });
    }
  }
  const std::pair<const char*, int64_t> models[] = {{"nano", 4096}, {"super", 8192}};
  for (const auto& [name, Di] : models) {
    const Tensor w = random(DType::kBF16, {Di}, 0.5f, 1.5f);
    for (int64_t T : {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{1024}, int64_t{8192}}) {
      const double bytes = 2.0 * T * Di * 2 + 1.0 * T * Di + 2.0 * Di;  // read y, z; write out_q
      struct Sets {
        Tensor y, z, q, normed;
      };
      std::vector<Sets> sets;
      for (int i = 0; i < rotations(bytes); ++i) {
        sets.push_back({random(DType::kBF16, {T, Di}), random(DType::kBF16, {T, Di}), random(DType::kF8E4M3, {T, Di}),
                        random(DType::kBF16, {T, Di})});
      }
      const auto at = [&](int i) -> const Sets& { return sets[static_cast<size_t>(i) % sets.size()]; };
      const std::string shape = "T=" + std::to_string(T) + " Di=" + std::to_string(Di) + " G=8 bf16 (" + name + ")";
      ctx.run_graph("gated_rms_norm_fp8", shape, bytes, 0, [&](cudaStream_t st, int i) {
        ops::gated_rms_norm_fp8(ops::Context{Device::kCuda, st}, at(i).q, at(i).y, at(i).z, w, 8, 1e-5f, s);
      });
      ctx.run_graph("gated_rms_norm+quantize_fp8", shape, bytes, 0, [&](cudaStream_t st, int i) {
        const ops::Context cs{Device::kCuda, st};
        ops::gated_rms_norm(cs, at(i).normed, at(i).y, at(i).z, w, 8, 1e-5f);
        ops::quantize_fp8(cs, at(i).q, at(i).normed, s);
      });
    }
  }
}

}  // namespace
}  // namespace chimera::bench
