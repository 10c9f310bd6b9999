// Benchmarks of the norm / dense / sampling family at Nemotron 3 Nano and Super shapes (docs/model.md 9):
// add + RMSNorm and RMSNorm (hidden 2688 / 4096 / 8192, 1..16384 tokens), gated RMSNorm (Mamba Di and
// groups), embedding, linear (in_proj / out_proj / lm_head, 1 / 64 / 4096 tokens) and sampling.
// Each case goes through the ops:: entry point (validation + launch, what the engine calls). Inputs are
// random, never zeros; buffer sets rotate so that a case's working set (>= 256 MiB when it can) is not
// served from the 50 MB L2 between iterations. bench/peers/norm_peers.py prints the same shapes for PyTorch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/gemm/gemv.h"
#include "backends/cuda/gemm/linear.h"
#include "backends/cuda/norm/row_norm.cuh"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "ops/ops.h"

namespace chimera::bench {
namespace {

constexpr double kRotateBytes = 256.0 * (1 << 20);

template <typename T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    const float u = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
    p[i] = cuda::from_float<T>(lo + (hi - lo) * u);
  }
}

// A device tensor of uniform values in [lo, hi).
Tensor random(DType dtype, Shape shape, float lo = -1.0f, float hi = 1.0f) {
  static uint64_t seed = 1;
  Tensor t = device::empty(Device::kCuda, dtype, std::move(shape));
  const int64_t n = t.numel();
  const int blocks = static_cast<int>(std::min<int64_t>(4096, (n + 255) / 256));
  CHIMERA_DISPATCH_FLOAT(dtype, "bench fill", T, {
    if (n > 0) fill_kernel<T><<<blocks, 256>>>(t.data_as<T>(), n, ++seed * 0x2545f4914f6cdd1dull, lo, hi);
  });
  return t;
}

// How many copies of a working set of `bytes` to rotate through.
int rotations(double bytes) {
  return static_cast<int>(std::clamp(kRotateBytes / std::max(bytes, 1.0), 1.0, 8.0));
}

std::string tokens_hidden(int64_t T, int64_t D) {
  return "T=" + std::to_string(T) + " D=" + std::to_string(D) + " bf16";
}

const int64_t kNormTokens[] = {1, 16, 64, 256, 1024, 4096, 16384};
const int64_t kNormHidden[] = {2688, 4096, 8192};
CHIMERA_BENCH(add_rms_norm_bf16) {
  const ops::Context c{Device::kCuda, nullptr};
  for (int64_t D : kNormHidden) {
    const Tensor w = random(DType::kBF16, {D}, 0.5f, 1.5f);
    for (int64_t T : kNormTokens) {
      const double bytes = 4.0 * T * D * 2 + D * 2.0;  // read x, residual; write residual, out
      struct Set {
        Tensor x, res, out;
      };
      std::vector<Set> sets;
      for (int i = 0; i < rotations(bytes); ++i) {
        sets.push_back({random(DType::kBF16, {T, D}), random(DType::kBF16, {T, D}), random(DType::kBF16, {T, D})});
      }
      size_t k = 0;
      const std::string shape = tokens_hidden(T, D);
      ctx.run("add_rms_norm", shape, bytes, 0, [&] {
        const Set& s = sets[k++ % sets.size()];
        ops::add_rms_norm(c, s.res, s.out, s.x, w, 1e-5f);
      });
      // The default launch (2 vector groups per thread) and the 4-per-thread variant, on device time.
      for (int vecs : {0, 4}) {
        ctx.run_graph(vecs == 0 ? "add_rms_norm" : "add_rms_norm-v4", shape, bytes, 0, [&](cudaStream_t st, int i) {
          const Set& s = sets[static_cast<size_t>(i) % sets.size()];
          const cuda::norm::RowNormParams p{s.out.data(),        s.x.data(), nullptr, s.res.data(), w.data(), T,
                                            static_cast<int>(D), 1,          1e-5f};
          cuda::norm::launch_add_rms_norm(p, DType::kBF16, DType::kBF16, st, vecs);
        });
      }
    }
  }
}

// The MoE layer's residual update: add2_rms_norm (residual += round(shared + routed), then the norm) against the
// two launches it replaces (add, then add + RMSNorm), at decode sizes of Nano (hidden 2688) and Super (4096).
// Bytes: read shared, routed, residual; write residual, out.
CHIMERA_BENCH(add2_rms_norm_bf16) {
  const ops::Context c{Device::kCuda, nullptr};
  for (int64_t D : {int64_t{2688}, int64_t{4096}}) {
    const Tensor w = random(DType::kBF16, {D}, 0.5f, 1.5f);
    for (int64_t T : {int64_t{1}, int64_t{8}, int64_t{64}}) {
      const double bytes = 5.0 * T * D * 2 + D * 2.0;
      struct Set {
        Tensor a, b, res, out, mix;
      };
      std::vector<Set> sets;
      for (int i = 0; i < rotations(bytes); ++i) {
        sets.push_back({random(DType::kBF16, {T, D}), random(DType::kBF16, {T, D}), random(DType::kBF16, {T, D}),
                        random(DType::kBF16, {T, D}), random(DType::kBF16, {T, D})});
      }
      size_t k = 0;
      const std::string shape = tokens_hidden(T, D);
      ctx.run("add2_rms_norm", shape, bytes, 0, [&] {
        const Set& s = sets[k++ % sets.size()];
        ops::add2_rms_norm(c, s.res, s.out, s.a, s.b, w, 1e-5f);
      });
      ctx.run_graph("add2_rms_norm", shape, bytes, 0, [&](cudaStream_t st, int i) {
        const Set& s = sets[static_cast<size_t>(i) % sets.size()];
        ops::add2_rms_norm(ops::Context{Device::kCuda, st}, s.res, s.out, s.a, s.b, w, 1e-5f);
      });
      ctx.run_graph("add+add_rms_norm", shape, bytes, 0, [&](cudaStream_t st, int i) {
        const Set& s = sets[static_cast<size_t>(i) % sets.size()];
        const ops::Context cs{Device::kCuda, st};
        ops::add(cs, s.mix, s.a, s.b);
        ops::add_rms_norm(cs, s.res, s.out, s.mix, w, 1e-5f);
      });
    }
  }
}

CHIMERA_BENCH(rms_norm_bf16) {
  const ops::Context c{Device::kCuda, nullptr};
  for (int64_t D : kNormHidden) {
    const Tensor w = random(DType::kBF16, {D}, 0.5f, 1.5f);
    for (int64_t T : kNormTokens) {
      const double bytes = 2.0 * T * D * 2 + D * 2.0;
      std::vector<std::pair<Tensor, Tensor>> sets;
      for (int i = 0; i < rotations(bytes); ++i)
        sets.emplace_back(random(DType::kBF16, {T, D}), random(DType::kBF16, {T, D}));
      size_t k = 0;
      const std::string shape = tokens_hidden(T, D);
      ctx.run("rms_norm", shape, bytes, 0, [&] {
        const auto& s = sets[k++ % sets.size()];
        ops::rms_norm(c, s.second, s.first, w, 1e-5f);
      });
      for (int vecs : {0, 4}) {
        ctx.run_graph(vecs == 0 ? "rms_norm" : "rms_norm-v4", shape, bytes, 0, [&](cudaStream_t st, int i) {
          const auto& s = sets[static_cast<size_t>(i) % sets.size()];
          const cuda::norm::RowNormParams p{
              s.second.data(), s.first.data(), nullptr, nullptr, w.data(), T, static_cast<int>(D), 1, 1e-5f};
          cuda::norm::launch_rms_norm(p, DType::kBF16, DType::kBF16, st, vecs);
        });
      }
    }
  }
}

// Mamba gated norm: Nano Di = 4096, Super Di = 8192, 8 groups each (docs/model.md 3.1).
CHIMERA_BENCH(gated_rms_norm_bf16) {
  const ops::Context c{Device::kCuda, nullptr};
  const std::pair<const char*, int64_t> models[] = {{"nano", 4096}, {"super", 8192}};
  for (const auto& [name, Di] : models) {
    const int64_t G = 8;
    const Tensor w = random(DType::kBF16, {Di}, 0.5f, 1.5f);
    for (int64_t T : {int64_t{1}, int64_t{64}, int64_t{1024}, int64_t{8192}}) {
      const double bytes = 3.0 * T * Di * 2 + Di * 2.0;
      struct Set {
        Tensor y, z, out;
      };
      std::vector<Set> sets;
      for (int i = 0; i < rotations(bytes); ++i) {
        sets.push_back({random(DType::kBF16, {T, Di}), random(DType::kBF16, {T, Di}), random(DType::kBF16, {T, Di})});
      }
      size_t k = 0;
      const std::string shape = "T=" + std::to_string(T) + " Di=" + std::to_string(Di) + " G=8 bf16 (" + name + ")";
      ctx.run("gated_rms_norm", shape, bytes, 0, [&] {
        const Set& s = sets[k++ % sets.size()];
        ops::gated_rms_norm(c, s.out, s.y, s.z, w, G, 1e-5f);
      });
      ctx.run_graph("gated_rms_norm", shape, bytes, 0, [&](cudaStream_t st, int i) {
        const Set& s = sets[static_cast<size_t>(i) % sets.size()];
        ops::gated_rms_norm(ops::Context{Device::kCuda, st}, s.out, s.y, s.z, w, G, 1e-5f);
      });
    }
  }
}

CHIMERA_BENCH(embedding_bf16) {
  const ops::Context c{Device::kCuda, nullptr};
  for (int64_t D : {int64_t{2688}, int64_t{4096}}) {
    const Tensor table = random(DType::kBF16, {131072, D});
    for (int64_t T : {int64_t{1}, int64_t{64}, int64_t{4096}}) {
      std::vector<int32_t> ids(static_cast<size_t>(T));
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 2654435761u) % 131072);
      Tensor out = random(DType::kBF16, {T, D});
      ctx.run("embedding", tokens_hidden(T, D) + " V=131072", 2.0 * T * D * 2, 0,
              [&] { ops::embedding(c, out, table, ids); });
    }
  }
}

// A dense layer's shape (bf16 weight [out, in]) and `n` rotated sets of x [T, in], W, y [T, out] for it.
struct LinearProj {
  const char* name;
  int64_t in, out;
};
struct LinearSet {
  Tensor x, w, y;
};
std::vector<LinearSet> linear_sets(const LinearProj& p, int64_t T, int n) {
  std::vector<LinearSet> sets;
  const float ws = 1.0f / std::sqrt(static_cast<float>(p.in));
  for (int i = 0; i < n; ++i) {
    sets.push_back({random(DType::kBF16, {T, p.in}), random(DType::kBF16, {p.out, p.in}, -ws, ws),
                    random(DType::kBF16, {T, p.out})});
  }
  return sets;
}
std::string linear_shape(const LinearProj& p, int64_t T) {
  return "T=" + std::to_string(T) + " in=" + std::to_string(p.in) + " out=" + std::to_string(p.out) + " bf16 (" +
         p.name + ")";
}

// The projections of Nano (D 2688, Di 4096, in_proj 10304 rows) and Super (D 4096, Di 8192, 18560 rows),
// and the 131072-row lm_head.
CHIMERA_BENCH(linear_bf16) {
  const ops::Context c{Device::kCuda, nullptr};
  const LinearProj projs[] = {{"nano_in_proj", 2688, 10304},  {"nano_out_proj", 4096, 2688},
                              {"nano_lm_head", 2688, 131072}, {"super_in_proj", 4096, 18560},
                              {"super_out_proj", 8192, 4096}, {"super_lm_head", 4096, 131072}};
  for (const LinearProj& p : projs) {
    for (int64_t T : {int64_t{1}, int64_t{64}, int64_t{4096}}) {
      const double bytes = 2.0 * (p.out * p.in + T * p.in + T * p.out);
      const double flops = 2.0 * T * p.in * p.out;
      const std::vector<LinearSet> sets = linear_sets(p, T, rotations(bytes));
      size_t k = 0;
      const std::string shape = linear_shape(p, T);
      ctx.run("linear", shape, bytes, flops, [&] {
        const LinearSet& s = sets[k++ % sets.size()];
        ops::linear(c, s.y, s.x, s.w);
      });
      if (T <= 64) {  // launch-bound sizes: also the device time inside a graph
        ctx.run_graph("linear", shape, bytes, flops, [&](cudaStream_t st, int i) {
          const LinearSet& s = sets[static_cast<size_t>(i) % sets.size()];
          ops::linear(ops::Context{Device::kCuda, st}, s.y, s.x, s.w);
        });
      }
    }
  }
}

// Decode-size dense layers (T = 1, 2, 4, 8) at every projection shape of a Nano / Super decode step: the plan's
// choice (ops::linear), the GEMV (with and without PDL) and cuBLASLt, device time per call in a CUDA graph;
// floor = bytes / 4.2 TB/s.
CHIMERA_BENCH(linear_decode) {
  const LinearProj projs[] = {{"nano_in_proj", 2688, 10304},     {"nano_out_proj", 4096, 2688},
                              {"nano_shared_up", 2688, 3712},    {"nano_shared_down", 3712, 2688},
                              {"nano_q_proj", 2688, 4096},       {"nano_kv_proj", 2688, 256},
                              {"nano_o_proj", 4096, 2688},       {"nano_lm_head", 2688, 131072},
                              {"super_in_proj", 4096, 18560},    {"super_out_proj", 8192, 4096},
                              {"super_latent_in", 4096, 1024}};
  for (const LinearProj& p : projs) {
    for (int64_t T : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}}) {
      const double bytes = 2.0 * (p.out * p.in + T * p.in + T * p.out);
      const double flops = 2.0 * T * p.in * p.out;
      const std::vector<LinearSet> sets = linear_sets(p, T, rotations(bytes));
      const std::string shape = linear_shape(p, T);
      const bool gemv_ok = cuda::linear_gemv_supported(sets[0].y, sets[0].x, sets[0].w);
      ctx.run_graph("linear_plan", shape, bytes, flops, [&](cudaStream_t st, int i) {
        const LinearSet& s = sets[static_cast<size_t>(i) % sets.size()];
        ops::linear(ops::Context{Device::kCuda, st}, s.y, s.x, s.w);
      });
      struct Variant {
        const char* kernel;
        int choice;
        bool pdl;
      };
      for (const Variant& v : {Variant{"linear_gemv", 0, true}, Variant{"linear_gemv_nopdl", 0, false},
                               Variant{"linear_cublas", cuda::kSeparate, false}}) {
        if (v.choice != cuda::kSeparate && !gemv_ok) continue;
        ops::KernelConfig kernels;
        kernels.pdl = v.pdl;
        ctx.run_graph(v.kernel, shape, bytes, flops, [&](cudaStream_t st, int i) {
          const LinearSet& s = sets[static_cast<size_t>(i) % sets.size()];
          cuda::linear_with_choice(ops::Context{Device::kCuda, st, nullptr, kernels}, s.y, s.x, s.w, Tensor(),
                                   v.choice);
        });
      }
    }
  }
}

// The residual step folded into the next layer's input projection (ops::residual_norm_linear) at decode sizes:
// the plan's choice, the one GEMV launch (the GEMV's own warps-per-row rule) and the two ops it replaces (add +
// RMSNorm kernel, then the dense layer), device time per call in a CUDA graph: Nano in_proj after a MoE layer
// (add2), Nano q/k/v after a Mamba layer, Super in_proj (add2). Floor = bytes / 4.2 TB/s (weights + residual,
// addends, new residual, outputs).
CHIMERA_BENCH(norm_linear_decode) {
  struct Shape {
    const char* name;
    int64_t D;
    std::vector<int64_t> rows;
    bool add2;
  };
  const Shape shapes[] = {{"nano_in_proj", 2688, {10304}, true},
                          {"nano_qkv", 2688, {4096, 256, 256}, false},
                          {"super_in_proj", 4096, {18560}, true}};
  for (const Shape& sh : shapes) {
    for (int64_t T : {int64_t{1}, int64_t{2}}) {
      int64_t rows = 0;
      for (int64_t r : sh.rows) rows += r;
      const double bytes = 2.0 * (rows * sh.D + T * sh.D * (sh.add2 ? 4 : 3) + T * rows + sh.D);
      const double flops = 2.0 * T * sh.D * rows;
      struct Set {
        Tensor residual, residual_out, a, b, norm_w, x;
        std::vector<Tensor> w, y;
      };
      std::vector<Set> sets;
      const float ws = 1.0f / std::sqrt(static_cast<float>(sh.D));
      for (int i = 0; i < rotations(bytes); ++i) {
        Set s{random(DType::kBF16, {T, sh.D}), random(DType::kBF16, {T, sh.D}), random(DType::kBF16, {T, sh.D}),
              sh.add2 ? random(DType::kBF16, {T, sh.D}) : Tensor(), random(DType::kBF16, {sh.D}, 0.5f, 1.5f),
              random(DType::kBF16, {T, sh.D}), {}, {}};
        for (int64_t r : sh.rows) {
          s.w.push_back(random(DType::kBF16, {r, sh.D}, -ws, ws));
          s.y.push_back(random(DType::kBF16, {T, r}));
        }
        sets.push_back(std::move(s));
      }
      const std::string shape = "T=" + std::to_string(T) + " D=" + std::to_string(sh.D) + " rows=" +
                                std::to_string(rows) + (sh.add2 ? " add2" : " add") + " bf16 (" + sh.name + ")";
      const auto step = [&](const Set& s) {
        return ops::ResidualNorm{s.residual, s.residual_out, s.a, s.b, s.norm_w, 1e-5f, s.x};
      };
      ctx.run_graph("residual_norm_linear_plan", shape, bytes, flops, [&](cudaStream_t st, int i) {
        const Set& s = sets[static_cast<size_t>(i) % sets.size()];
        ops::residual_norm_linear(ops::Context{Device::kCuda, st}, step(s), s.y, s.w);
      });
      for (int choice : {0, cuda::kSeparate}) {
        ctx.run_graph(choice == 0 ? "residual_norm_linear" : "add_norm_then_linear", shape, bytes, flops,
                      [&](cudaStream_t st, int i) {
                        const Set& s = sets[static_cast<size_t>(i) % sets.size()];
                        cuda::residual_norm_linear_with_choice(ops::Context{Device::kCuda, st}, step(s), s.y, s.w,
                                                               Tensor(), choice);
                      });
      }
    }
  }
}

// The offline tuning of the dense-layer plan (gemm/linear.h, sm90_linear_table.inc): every decode-size shape of a
// Nano / Super step (T = 1, 2; bf16) with every candidate choice, device time per call inside a CUDA graph (as a
// captured decode step runs it). One line per candidate ("TUNE ... us=") and one per shape with the fastest
// ("PLAN kind tokens in out choice", ties to the earlier candidate): scripts/make_linear_table.py turns the PLAN
// lines into the table. About 30 s on the H200.
CHIMERA_BENCH(linear_tune) {
  Context quick = ctx;
  quick.warmup = 3;
  quick.iters = 15;
  struct Linear {
    int64_t in, out;
  };
  // kLinear: every projection that runs as ops::linear at decode sizes (including the parts of the multi / norm
  // shapes below, which run as linears when those paths do not apply).
  const Linear linears[] = {{2688, 10304}, {4096, 2688}, {2688, 3712}, {3712, 2688}, {2688, 4096},
                            {2688, 256},   {4096, 18560}, {8192, 4096}, {4096, 1024}, {1024, 4096},
                            {4096, 4096},  {4096, 5376},  {5376, 4096}, {4096, 256}};
  struct Parts {
    int64_t D;
    std::vector<int64_t> rows;
  };
  const Parts multis[] = {{2688, {4096, 256, 256}}, {4096, {4096, 256, 256}}};
  const Parts norms[] = {{2688, {10304}}, {2688, {4096, 256, 256}}, {4096, {18560}}, {4096, {4096, 256, 256}}};
  const auto report = [](int kind, int64_t T, int64_t in, int64_t out, int choice, double us) {
    std::printf("TUNE kind=%d tokens=%lld in=%lld out=%lld choice=%d us=%.3f\n", kind, static_cast<long long>(T),
                static_cast<long long>(in), static_cast<long long>(out), choice, us);
  };
  const auto plan = [](int kind, int64_t T, int64_t in, int64_t out, int choice) {
    std::printf("PLAN %d %lld %lld %lld %d\n", kind, static_cast<long long>(T), static_cast<long long>(in),
                static_cast<long long>(out), choice);
    std::fflush(stdout);
  };
  for (int64_t T : {int64_t{1}, int64_t{2}}) {
    for (const Linear& l : linears) {
      const LinearProj p{"tune", l.in, l.out};
      const double bytes = 2.0 * (l.out * l.in + T * l.in + T * l.out);
      const std::vector<LinearSet> sets = linear_sets(p, T, rotations(bytes));
      if (!cuda::linear_gemv_supported(sets[0].y, sets[0].x, sets[0].w)) continue;
      int best = cuda::kSeparate;
      double best_us = 0.0;
      for (int choice : {cuda::kSeparate, 0, 1, 2, 4}) {
        const double us = quick.run_graph("linear_tune", linear_shape(p, T) + " choice=" + std::to_string(choice),
                                          bytes, 0.0, [&](cudaStream_t st, int i) {
                                            const LinearSet& s = sets[static_cast<size_t>(i) % sets.size()];
                                            cuda::linear_with_choice(ops::Context{Device::kCuda, st}, s.y, s.x, s.w,
                                                                     Tensor(), choice);
                                          });
        report(0, T, l.in, l.out, choice, us);
        if (choice == cuda::kSeparate || us < best_us) best = choice, best_us = us;
      }
      plan(0, T, l.in, l.out, best);
    }
    const float lo = -0.02f, hi = 0.02f;
    for (const Parts& m : multis) {
      int64_t rows = 0;
      std::vector<Tensor> w, y;
      for (int64_t r : m.rows) {
        rows += r;
        w.push_back(random(DType::kBF16, {r, m.D}, lo, hi));
        y.push_back(random(DType::kBF16, {T, r}));
      }
      const Tensor x = random(DType::kBF16, {T, m.D});
      const double bytes = 2.0 * (rows * m.D + T * m.D + T * rows);
      int best = 0;
      double best_us = 0.0;
      for (int choice : {0, 1, 2, 4}) {
        const double us = quick.run_graph(
            "linear_multi_tune", "T=" + std::to_string(T) + " D=" + std::to_string(m.D) + " rows=" + std::to_string(rows),
            bytes, 0.0, [&](cudaStream_t st, int) {
              cuda::linear_multi_with_choice(ops::Context{Device::kCuda, st}, y, x, w, choice);
            });
        report(1, T, m.D, rows, choice, us);
        if (choice == 0 || us < best_us) best = choice, best_us = us;
      }
      plan(1, T, m.D, rows, best);
    }
    for (const Parts& n : norms) {
      for (bool add2 : {false, true}) {
        int64_t rows = 0;
        std::vector<Tensor> w, y;
        for (int64_t r : n.rows) {
          rows += r;
          w.push_back(random(DType::kBF16, {r, n.D}, lo, hi));
          y.push_back(random(DType::kBF16, {T, r}));
        }
        const Tensor residual = random(DType::kBF16, {T, n.D}), residual_out = random(DType::kBF16, {T, n.D});
        const Tensor a = random(DType::kBF16, {T, n.D}), b = add2 ? random(DType::kBF16, {T, n.D}) : Tensor();
        const Tensor norm_w = random(DType::kBF16, {n.D}, 0.5f, 1.5f), x = random(DType::kBF16, {T, n.D});
        const ops::ResidualNorm rn{residual, residual_out, a, b, norm_w, 1e-5f, x};
        const ops::Context probe{Device::kCuda, nullptr};
        if (!cuda::residual_norm_linear_fused(probe, rn, y, w, Tensor())) continue;
        const int kind = add2 ? 3 : 2;
        const double bytes = 2.0 * (rows * n.D + T * n.D * (add2 ? 4 : 3) + T * rows + n.D);
        int best = cuda::kSeparate;
        double best_us = 0.0;
        for (int choice : {cuda::kSeparate, 0, 1, 2, 4}) {
          const double us = quick.run_graph(
              "residual_norm_linear_tune",
              "T=" + std::to_string(T) + " D=" + std::to_string(n.D) + " rows=" + std::to_string(rows) +
                  (add2 ? " add2" : " add") + " choice=" + std::to_string(choice),
              bytes, 0.0, [&](cudaStream_t st, int) {
                cuda::residual_norm_linear_with_choice(ops::Context{Device::kCuda, st}, rn, y, w, Tensor(), choice);
              });
          report(kind, T, n.D, rows, choice, us);
          if (choice == cuda::kSeparate || us < best_us) best = choice, best_us = us;
        }
        plan(kind, T, n.D, rows, best);
      }
    }
  }
}

// Sampling over the 131072-token vocabulary: greedy, and temperature + top-k 50 + top-p 0.9. Greedy at decode
// batch sizes also inside a CUDA graph (no row upload on that path, so it captures): the device time per call.
CHIMERA_BENCH(sample_tokens) {
  const ops::Context c{Device::kCuda, nullptr};
  const int64_t V = 131072;
  for (int64_t R : {int64_t{1}, int64_t{4}, int64_t{64}, int64_t{256}}) {
    // Enough row sets that the graph's calls do not all hit L2 (256 MiB, as the other cases).
    const int64_t n_sets =
        std::max<int64_t>(1, std::min<int64_t>(kGraphLaunches, static_cast<int64_t>(kRotateBytes / (4.0 * R * V))));
    std::vector<Tensor> logits;
    for (int64_t i = 0; i < n_sets; ++i) logits.push_back(random(DType::kF32, {R, V}, -8.0f, 8.0f));
    Tensor ids = device::empty(Device::kCuda, DType::kI32, {R});
    for (const bool greedy : {true, false}) {
      std::vector<ops::SamplingRow> rows(static_cast<size_t>(R));
      for (size_t r = 0; r < rows.size(); ++r) {
        rows[r] = greedy ? ops::SamplingRow{} : ops::SamplingRow{0.8f, 50, 0.9f, 7, r};
      }
      const std::string shape = "R=" + std::to_string(R) + " V=131072 f32 " + (greedy ? "greedy" : "t0.8_k50_p0.9");
      ctx.run("sample_tokens", shape, 4.0 * R * V, 0, [&] { ops::sample_tokens(c, ids, logits[0], rows); });
      if (greedy && R <= 64) {
        ctx.run_graph("sample_tokens", shape, 4.0 * R * V, 0, [&](cudaStream_t st, int i) {
          ops::sample_tokens(ops::Context{Device::kCuda, st}, ids, logits[static_cast<size_t>(i % n_sets)], rows);
        });
      }
    }
  }
}

}  // namespace
}  // namespace chimera::bench
