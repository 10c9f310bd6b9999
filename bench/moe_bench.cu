// MoE kernel benchmarks at the Nemotron 3 shapes (docs/model.md 9): the fused router (Super E=512 / top-22, Nano
// E=128 / top-6) and the routed experts (permute + grouped up GEMM + relu2 + grouped down GEMM + combine).
// Each case times the public op (ops::router_topk / ops::moe_experts), host validation and launches included.
//
// Bytes and flops (the floors):
//   router:  reads logits [T, E] f32 + bias, writes ids and weights [T, k] -> latency-bound below ~1k tokens
//   experts: the expert weights actually touched (distinct routed experts x 2 x I x D x 2 bytes, counted from
//            the routing of the run) + x + out;
//            flops = 2 GEMMs x 2 x (T * k) x I x D. GB/s counts the weight stream (what decode is bound by).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/moe/experts.h"
#include "backends/cuda/moe/moe_kernels.h"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "ops/ops.h"

namespace chimera::bench {
namespace {

// Deterministic pseudo-random fill on the device (weights of several GB are not worth generating on the host).
__global__ void fill_uniform_kernel(__nv_bfloat16* p, int64_t n, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed ^ static_cast<uint32_t>(i >> 32) * 40503u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float u = static_cast<float>(h) * (1.0f / 4294967296.0f) * 2.0f - 1.0f;
    p[i] = __float2bfloat16(u * scale);
  }
}
__global__ void fill_normalish_kernel(float* p, int64_t n, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (uint32_t j = 0; j < 4; ++j) {  // sum of 4 uniforms: close enough to a normal for routing
      uint32_t h = (static_cast<uint32_t>(i) * 4u + j) * 2654435761u ^ seed;
      h ^= h >> 15;
      h *= 2246822519u;
      h ^= h >> 13;
      s += static_cast<float>(h) * (1.0f / 4294967296.0f) - 0.5f;
    }
    p[i] = s * scale * 1.7320508f;
  }
}

Tensor random_bf16(Shape shape, float scale, uint32_t seed) {
  Tensor t = device::empty(Device::kCuda, DType::kBF16, std::move(shape));
  fill_uniform_kernel<<<1024, 256>>>(t.data_as<__nv_bfloat16>(), t.numel(), scale, seed);
  return t;
}
Tensor random_f32(Shape shape, float scale, uint32_t seed) {
  Tensor t = device::empty(Device::kCuda, DType::kF32, std::move(shape));
  fill_normalish_kernel<<<1024, 256>>>(t.data_as<float>(), t.numel(), scale, seed);
  return t;
}
Tensor to_dtype(const Tensor& f32, DType dtype) {
  return dtype == DType::kF32 ? f32 : device::to_device(device::to_host(f32), Device::kCuda, dtype);
}

std::string router_shape(int64_t E, int64_t k, int64_t T) {
  return "E=" + std::to_string(E) + " k=" + std::to_string(k) + " T=" + std::to_string(T);
}

void bench_router(const Context& ctx, int64_t E, int64_t k, float scale) {
  const ops::Context c{Device::kCuda, nullptr};
  const Tensor bias = random_f32({E}, 0.05f, 7);
  for (int64_t T : {1, 16, 64, 256, 1024, 4096}) {
    const Tensor logits = random_f32({T, E}, 2.0f, static_cast<uint32_t>(T));
    Tensor ids = device::empty(Device::kCuda, DType::kI32, {T, k});
    Tensor w = device::empty(Device::kCuda, DType::kF32, {T, k});
    const double bytes = static_cast<double>(T * E * 4 + E * 4 + T * k * 8);
    ctx.run("router_topk", router_shape(E, k, T), bytes, 0.0,
            [&] { ops::router_topk(c, ids, w, logits, bias, {k, 1, 1, true, scale}); });
    // Device time per launch of each kernel (CUDA graph of kGraphLaunches launches, no host overhead), and
    // a check that both kernels route identically (choices and weights bit for bit).
    cuda::moe::RouterParams p{};
    p.logits = logits.data(), p.bias = bias.data(), p.topk_ids = ids.data_as<int32_t>();
    p.topk_weights = w.data_as<float>();
    p.T = static_cast<int>(T), p.E = static_cast<int>(E), p.k = static_cast<int>(k), p.n_group = 1;
    p.topk_group = 1, p.norm_topk_prob = true, p.routed_scaling_factor = scale;
    p.logits_dtype = DType::kF32, p.bias_dtype = DType::kF32;
    std::vector<Tensor> outs;
    for (int kernel : {1, 2}) {
      p.kernel = kernel;
      ctx.run_graph(kernel == 1 ? "router_topk-warp" : "router_topk-block", router_shape(E, k, T), bytes, 0,
                    [&](cudaStream_t st, int) { cuda::moe::launch_router_topk(p, st); });
      outs.push_back(device::to_host(ids));
      outs.push_back(device::to_host(w));
    }
    const bool same = std::equal(outs[0].i32(), outs[0].i32() + outs[0].numel(), outs[2].i32()) &&
                      std::memcmp(outs[1].data(), outs[3].data(), outs[1].nbytes()) == 0;
    std::printf("CHECK router_topk %s warp-vs-block %s\n", router_shape(E, k, T).c_str(),
                same ? "identical" : "DIFFERENT");
  }
}

CHIMERA_BENCH(moe_router_super) { bench_router(ctx, 512, 22, 5.0f); }
CHIMERA_BENCH(moe_router_nano) { bench_router(ctx, 128, 6, 2.5f); }

// The router from its input (ops::router_gate_topk) at decode sizes: bf16 x [T, D], the fp32 gate [E, D]. Per T:
// the op call; its device time in a CUDA graph ("router_gate_topk-graph": the fused kernel for T <= 16, the three-op
// path above); the path it replaces in a graph ("router_3op-graph": x -> fp32, cuBLASLt fp32 logits, router_topk);
// for T <= 4 the op's two decode kernels ("-cluster" where it applies, "-splitk"); for T <= 16 both selections of
// the split-K kernel ("-warpsel" / "-blocksel"), with CHECK lines: the two selections
// identical, and the fused choices against the three-op path (equal up to fp32 summation order: a differing token
// is a near-tie). Bytes: the fp32 gate (what the GEMV streams) + x + outputs.
void bench_router_gate(const Context& ctx, const char* model, int64_t E, int64_t k, int64_t D, int64_t n_group,
                       int64_t topk_group, float scale) {
  const ops::Context c{Device::kCuda, nullptr};
  const Tensor gate = random_f32({E, D}, 1.0f / std::sqrt(static_cast<float>(D)), 31);
  const Tensor bias = random_f32({E}, 0.05f, 37);
  const ops::RouterParams rp{k, n_group, topk_group, true, scale};
  for (int64_t T : {1, 2, 4, 8, 64}) {
    const Tensor x = to_dtype(random_f32({T, D}, 1.0f, static_cast<uint32_t>(300 + T)), DType::kBF16);
    Tensor ids = device::empty(Device::kCuda, DType::kI32, {T, k});
    Tensor w = device::empty(Device::kCuda, DType::kF32, {T, k});
    const double bytes = static_cast<double>(E * D * 4 + T * D * 2 + E * 4 + T * k * 8);
    const std::string shape = std::string(model) + " E=" + std::to_string(E) + " k=" + std::to_string(k) +
                              " groups=" + std::to_string(n_group) + " D=" + std::to_string(D) +
                              " T=" + std::to_string(T) + " x=bf16";
    ctx.run("router_gate_topk", shape, bytes, 0, [&] { ops::router_gate_topk(c, ids, w, x, gate, bias, rp); });
    ctx.run_graph("router_gate_topk", shape, bytes, 0, [&](cudaStream_t st, int) {
      ops::router_gate_topk(ops::Context{Device::kCuda, st}, ids, w, x, gate, bias, rp);
    });
    const Tensor fused_ids = device::to_host(ids), fused_w = device::to_host(w);
    Tensor x32 = device::empty(Device::kCuda, DType::kF32, {T, D});
    Tensor logits = device::empty(Device::kCuda, DType::kF32, {T, E});
    ctx.run_graph("router_3op", shape, bytes, 0, [&](cudaStream_t st, int) {
      const ops::Context cs{Device::kCuda, st};
      ops::convert(cs, x32, x);
      ops::linear(cs, logits, x32, gate);
      ops::router_topk(cs, ids, w, logits, bias, rp);
    });
    const Tensor ref_ids = device::to_host(ids), ref_w = device::to_host(w);
    int64_t tokens_differ = 0;
    double max_w_diff = 0;
    for (int64_t t = 0; t < T; ++t) {
      bool same = true;
      for (int64_t j = 0; j < k; ++j) same = same && fused_ids.i32()[t * k + j] == ref_ids.i32()[t * k + j];
      tokens_differ += same ? 0 : 1;
      for (int64_t j = 0; same && j < k; ++j) {
        max_w_diff = std::max(max_w_diff, static_cast<double>(std::fabs(fused_w.f32()[t * k + j] - ref_w.f32()[t * k + j])));
      }
    }
    std::printf("CHECK router_gate_topk %s fused-vs-3op tokens_with_other_choices=%lld max_weight_diff=%.3g %s\n",
                shape.c_str(), static_cast<long long>(tokens_differ), max_w_diff,
                tokens_differ == 0 && max_w_diff <= 1e-5 * scale ? "identical-choices" : "DIFFERENT (near-ties?)");
    // The two decode kernels of the op (KernelConfig::router_cluster): the single-cluster kernel where the gate
    // slice fits (Nano; not Super) and the split-K kernel with its ticket, with a CHECK that they route alike (the
    // logits differ by fp32 summation order only).
    if (T <= cuda::moe::kGateClusterMaxTokens) {
      std::vector<Tensor> kouts;
      int cluster_size = 0;
      for (const bool cluster : {true, false}) {
        ops::Context kc = c;
        kc.kernels.router_cluster = cluster;
        ops::router_gate_topk(kc, ids, w, x, gate, bias, rp);
        CHIMERA_CUDA_CHECK(cudaDeviceSynchronize(), "bench router_gate_topk");
        const int used = cuda::moe::router_gate_last_cluster();
        if (cluster) cluster_size = used;
        if (!cluster || used > 0) {
          ctx.run_graph(cluster ? "router_gate_topk-cluster" : "router_gate_topk-splitk", shape, bytes, 0,
                        [&](cudaStream_t st, int) {
                          ops::Context gc = kc;
                          gc.stream = st;
                          ops::router_gate_topk(gc, ids, w, x, gate, bias, rp);
                        });
        }
        kouts.push_back(device::to_host(ids));
        kouts.push_back(device::to_host(w));
      }
      int64_t differ = 0;
      for (int64_t i = 0; i < T * k; ++i) differ += kouts[0].i32()[i] != kouts[2].i32()[i] ? 1 : 0;
      std::printf("INFO router_gate_topk %s cluster_size=%d (0: the split-K kernel)\n", shape.c_str(), cluster_size);
      std::printf("CHECK router_gate_topk %s cluster-vs-splitk ids_differ=%lld %s\n", shape.c_str(),
                  static_cast<long long>(differ), differ == 0 ? "identical-choices" : "DIFFERENT (near-ties?)");
    }
    if (T > cuda::moe::kGateMaxTokens) continue;
    cuda::moe::GateTopkParams g{};
    g.route.bias = bias.data(), g.route.bias_dtype = DType::kF32, g.route.topk_ids = ids.data_as<int32_t>();
    g.route.topk_weights = w.data_as<float>(), g.route.T = static_cast<int>(T), g.route.E = static_cast<int>(E);
    g.route.k = static_cast<int>(k), g.route.n_group = static_cast<int>(n_group);
    g.route.topk_group = static_cast<int>(topk_group), g.route.norm_topk_prob = true;
    g.route.routed_scaling_factor = scale, g.route.logits_dtype = DType::kF32;
    g.x = x.data(), g.x_dtype = DType::kBF16, g.gate = gate.data_as<float>(), g.D = static_cast<int>(D);
    g.split = cuda::moe::gate_topk_split(g.route.E, g.D);
    const Tensor partial = device::empty(Device::kCuda, DType::kF32, {g.split.n_split, T, E});
    g.partial = partial.data_as<float>();
    std::printf("INFO router_gate_topk %s grid=%dx%d chunk=%d\n", shape.c_str(), g.split.n_split,
                static_cast<int>((E + cuda::moe::kGateWarps - 1) / cuda::moe::kGateWarps), g.split.chunk);
    std::vector<Tensor> outs;
    for (int select : {1, 2}) {
      g.select = select;
      ctx.run_graph(select == 1 ? "router_gate_topk-warpsel" : "router_gate_topk-blocksel", shape, bytes, 0,
                    [&](cudaStream_t st, int) { cuda::moe::launch_router_gate_topk(g, st); });
      outs.push_back(device::to_host(ids));
      outs.push_back(device::to_host(w));
    }
    const bool same = std::equal(outs[0].i32(), outs[0].i32() + outs[0].numel(), outs[2].i32()) &&
                      std::memcmp(outs[1].data(), outs[3].data(), outs[1].nbytes()) == 0;
    std::printf("CHECK router_gate_topk %s warpsel-vs-blocksel %s\n", shape.c_str(), same ? "identical" : "DIFFERENT");
    // The column split (fewer splits: fewer blocks in phase 1, fewer partials for the last block to sum) at
    // T = 1 and 8, both selections: which split gate_topk_split should pick.
    if (T != 1 && T != 8) continue;
    const cuda::moe::GateSplit def = g.split;
    for (int want : {1, 2, 3, 4, 6, 8, 12}) {
      const int chunk = static_cast<int>((D + want - 1) / want + 3) / 4 * 4;
      if (chunk > cuda::moe::kGateMaxChunk) continue;
      g.split = {static_cast<int>((D + chunk - 1) / chunk), chunk};
      if (g.split.n_split >= def.n_split) continue;
      for (int select : {1, 2}) {
        g.select = select;
        ctx.run_graph(std::string("router_gate_topk-split") + std::to_string(g.split.n_split) +
                          (select == 1 ? "-warpsel" : "-blocksel"),
                      shape, bytes, 0, [&](cudaStream_t st, int) { cuda::moe::launch_router_gate_topk(g, st); });
      }
    }
    g.split = def;
  }
}

// Nano: 128 experts / top-6 on hidden 2688; Super: 512 / top-22 on hidden 4096 (the router reads the full hidden
// state, not the latent one); and a group-limited 512-expert router (the warp selection with groups).
CHIMERA_BENCH(moe_router_gate_nano) { bench_router_gate(ctx, "nano", 128, 6, 2688, 1, 1, 2.5f); }
CHIMERA_BENCH(moe_router_gate_super) { bench_router_gate(ctx, "super", 512, 22, 4096, 1, 1, 5.0f); }
CHIMERA_BENCH(moe_router_gate_groups) { bench_router_gate(ctx, "grouped", 512, 22, 4096, 8, 2, 5.0f); }

// Routed experts at one shape: expert weights (views into one fused tensor per projection), one routing per T.
struct ExpertsCase {
  const char* model;
  int64_t E, k, D, I;
  float scale;
  std::vector<Tensor> up, down;
  Tensor up_fused, down_fused, bias;
  ExpertsCase(const char* model_, int64_t E_, int64_t k_, int64_t D_, int64_t I_, float scale_)
      : model(model_), E(E_), k(k_), D(D_), I(I_), scale(scale_) {
    up_fused = random_bf16({E, I, D}, 1.7320508f / std::sqrt(static_cast<float>(D)), 11);
    down_fused = random_bf16({E, D, I}, 1.7320508f / std::sqrt(static_cast<float>(I)), 13);
    for (int64_t e = 0; e < E; ++e) {
      up.push_back(up_fused.select(e));
      down.push_back(down_fused.select(e));
    }
    bias = random_f32({E}, 0.05f, 17);
  }
};

// The inputs of one token count: routing from the router on random logits, x, out; the bytes and flops of the
// floor (weights of the experts this routing touches, counted on the host).
struct ExpertsInputs {
  Tensor ids, w, x, out;
  double bytes = 0, flops = 0;
  size_t touched = 0;
  std::string shape;
};
ExpertsInputs experts_inputs(const ExpertsCase& c, int64_t T, DType x_dtype) {
  const ops::Context cx{Device::kCuda, nullptr};
  ExpertsInputs in;
  const Tensor logits = random_f32({T, c.E}, 2.0f, static_cast<uint32_t>(100 + T));
  in.ids = device::empty(Device::kCuda, DType::kI32, {T, c.k});
  in.w = device::empty(Device::kCuda, DType::kF32, {T, c.k});
  ops::router_topk(cx, in.ids, in.w, logits, c.bias, {c.k, 1, 1, true, c.scale});
  in.x = to_dtype(random_f32({T, c.D}, 1.0f, static_cast<uint32_t>(200 + T)), x_dtype);
  in.out = device::empty(Device::kCuda, x_dtype, {T, c.D});
  const Tensor host_ids = device::to_host(in.ids);
  in.touched = std::set<int32_t>(host_ids.i32(), host_ids.i32() + host_ids.numel()).size();
  const double weight_bytes = static_cast<double>(in.touched) * 2.0 * static_cast<double>(c.I * c.D) * 2.0;
  const double act_bytes = 2.0 * static_cast<double>(T * c.D * dtype_size(x_dtype));
  in.bytes = weight_bytes + act_bytes;
  in.flops = 2.0 * 2.0 * static_cast<double>(T * c.k) * static_cast<double>(c.I * c.D);
  in.shape = std::string(c.model) + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k) +
             " D=" + std::to_string(c.D) + " I=" + std::to_string(c.I) + " T=" + std::to_string(T) +
             " x=" + std::string(dtype_name(x_dtype));
  return in;
}

// Routed experts; the same routing for every timed call.
void bench_experts(const Context& ctx, const char* model, int64_t E, int64_t k, int64_t D, int64_t I, float scale,
                   DType x_dtype, std::initializer_list<int64_t> tokens) {
  const ops::Context c{Device::kCuda, nullptr};
  const ExpertsCase ec(model, E, k, D, I, scale);
  for (int64_t T : tokens) {
    ExpertsInputs in = experts_inputs(ec, T, x_dtype);
    ctx.run("moe_experts", in.shape, in.bytes, in.flops,
            [&] { ops::moe_experts(c, in.out, in.x, in.ids, in.w, ec.up, ec.down); });
  }
}

// Decode token counts (target: batch-1 decode at >= 0.6 of the weight-streaming floor, docs/perf.md). Per T: the public op
// call (automatic path; CUDA events around host validation + 4 launches), then the device time of the whole op
// (permute + up + down + combine) inside a CUDA graph of kGraphLaunches calls, what a captured decode step pays,
// on the GEMV path ("moe_experts-gemv-graph") and on the tensor-core path ("moe_experts-mma-graph"), plus a check
// that the two agree. The replays reuse one routing: the touched weights (Nano 120 MB at T = 1, Super 242 MB) are
// larger than the 50 MB L2, so a replay still streams them from HBM (a little L2 reuse between calls is possible
// at T = 1; compare the op call's GB/s too).
void bench_experts_decode(const Context& ctx, const char* model, int64_t E, int64_t k, int64_t D, int64_t I,
                          float scale) {
  const char* what = "bench moe_experts graph";
  const ExpertsCase ec(model, E, k, D, I, scale);
  for (int64_t T : {1, 2, 4, 8}) {
    ExpertsInputs in = experts_inputs(ec, T, DType::kBF16);
    std::printf("INFO moe_experts %s touched_experts=%zu floor_us=%.2f\n", in.shape.c_str(), in.touched,
                in.bytes / (kCopyBandwidthGBs * 1e3));
    const ops::Context c{Device::kCuda, nullptr};
    ctx.run("moe_experts", in.shape, in.bytes, in.flops,
            [&] { ops::moe_experts(c, in.out, in.x, in.ids, in.w, ec.up, ec.down); });
    std::vector<Tensor> results;
    for (cuda::moe::ExpertsPath path : {cuda::moe::ExpertsPath::kGemv, cuda::moe::ExpertsPath::kMma}) {
      const bool gemv = path == cuda::moe::ExpertsPath::kGemv;
      const auto call = [&](cudaStream_t st) {
        cuda::moe::moe_experts_on_path(ops::Context{Device::kCuda, st}, in.out, in.x, in.ids, in.w, ec.up, ec.down,
                                       path);
      };
      call(nullptr);
      results.push_back(device::to_host_f32(in.out));
      ctx.run_graph(gemv ? "moe_experts-gemv" : "moe_experts-mma", in.shape, in.bytes, in.flops,
                    [&](cudaStream_t st, int) { call(st); });
      CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
    }
    // Same inputs, fp32 accumulation on both paths, h rounded to bf16 on both: expect agreement to ~1e-2 relative.
    double max_diff = 0, max_ref = 0;
    for (int64_t i = 0; i < results[0].numel(); ++i) {
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(results[0].f32()[i] - results[1].f32()[i])));
      max_ref = std::max(max_ref, static_cast<double>(std::fabs(results[1].f32()[i])));
    }
    std::printf("CHECK moe_experts %s gemv-vs-mma max_abs_diff=%.3g max_abs=%.3g %s\n", in.shape.c_str(), max_diff,
                max_ref, max_diff <= 2e-2 * std::max(1.0, max_ref) ? "close" : "DIFFERENT");
  }
}

// Prefill token counts (the grouped expert GEMMs at many tokens per expert): per T, the op on a forced path,
// "moe_experts-mma" (the mma.sync kernel, what kAuto runs here) and, in a build with -DCHIMERA_CUTLASS=ON,
// "moe_experts-cutlass" (CUTLASS's sm90 grouped GEMM: prepare + 2 GEMMs + combine), each as an op call (CUDA events
// around host work + launches: ctx.run) and as device time inside a CUDA graph (run_graph, "<name>-graph"; the
// CUTLASS path is captured with its device-side group shapes, which is what the graph case checks). A CHECK line
// compares the two outputs (both accumulate in fp32 and round h to bf16; the summation order inside the tensor-core
// instructions may differ, so "identical" is not required: "close" is). Then the CUTLASS path's token tiles forced,
// graph only: "moe_experts-cutlass-n64-graph", "moe_experts-cutlass-n128-graph".
void bench_experts_prefill(const Context& ctx, const char* model, int64_t E, int64_t k, int64_t D, int64_t I,
                           float scale) {
  const char* what = "bench moe_experts prefill";
  const ExpertsCase ec(model, E, k, D, I, scale);
  for (int64_t T : {64, 1024, 4096}) {
    ExpertsInputs in = experts_inputs(ec, T, DType::kBF16);
    std::printf("INFO moe_experts %s touched_experts=%zu weight_floor_us=%.2f flop_floor_us=%.2f\n", in.shape.c_str(),
                in.touched, in.bytes / (kCopyBandwidthGBs * 1e3), in.flops / (kBf16PeakTflops * 1e6));
    std::vector<cuda::moe::ExpertsPath> paths = {cuda::moe::ExpertsPath::kMma};
    if (cuda::moe::cutlass_built()) paths.push_back(cuda::moe::ExpertsPath::kCutlass);
    std::vector<Tensor> results;
    for (cuda::moe::ExpertsPath path : paths) {
      const std::string name = path == cuda::moe::ExpertsPath::kMma ? "moe_experts-mma" : "moe_experts-cutlass";
      const auto call = [&](cudaStream_t st) {
        cuda::moe::moe_experts_on_path(ops::Context{Device::kCuda, st}, in.out, in.x, in.ids, in.w, ec.up, ec.down,
                                       path);
      };
      call(nullptr);
      results.push_back(device::to_host_f32(in.out));
      ctx.run(name, in.shape, in.bytes, in.flops, [&] { call(nullptr); });
      ctx.run_graph(
          name, in.shape, in.bytes, in.flops, [&](cudaStream_t st, int) { call(st); }, 5);
      CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
      // The graph's output equals the eager call's (the graph replays the same routing and inputs).
      const Tensor again = device::to_host_f32(in.out);
      std::printf("CHECK moe_experts %s %s graph-vs-eager %s\n", in.shape.c_str(), name.c_str(),
                  std::memcmp(again.data(), results.back().data(), again.nbytes()) == 0 ? "identical" : "DIFFERENT");
    }
    if (results.size() < 2) continue;
    // The CUTLASS path's two token tiles forced (the automatic choice above: 128 when P / min(E, P) > 96).
    for (int tile_n : {64, 128}) {
      ops::KernelConfig kernels;
      kernels.moe_cutlass_tile_n = tile_n;
      const auto call = [&](cudaStream_t st) {
        cuda::moe::moe_experts_on_path(ops::Context{Device::kCuda, st, nullptr, kernels}, in.out, in.x, in.ids, in.w, ec.up, ec.down,
                                       cuda::moe::ExpertsPath::kCutlass);
      };
      ctx.run_graph(
          std::string("moe_experts-cutlass-n") + std::to_string(tile_n), in.shape, in.bytes, in.flops,
          [&](cudaStream_t st, int) { call(st); }, 5);
      CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
    }
    double max_diff = 0, max_ref = 0;
    int64_t differ = 0;
    for (int64_t i = 0; i < results[0].numel(); ++i) {
      const float a = results[0].f32()[i], b = results[1].f32()[i];
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(a - b)));
      max_ref = std::max(max_ref, static_cast<double>(std::fabs(a)));
      differ += a != b ? 1 : 0;
    }
    std::printf("CHECK moe_experts %s cutlass-vs-mma max_abs_diff=%.3g max_abs=%.3g differing=%lld/%lld %s\n",
                in.shape.c_str(), max_diff, max_ref, static_cast<long long>(differ),
                static_cast<long long>(results[0].numel()),
                max_diff <= 2e-2 * std::max(1.0, max_ref) ? "close" : "DIFFERENT");
  }
}

// A decode MoE layer's experts with its shared expert: per T = 1, 2, 4, 8, graph device time of
//   "moe_layer-old": ops::moe_experts (4 launches) + ops::relu2_mlp (cuBLASLt up, relu2, cuBLASLt down)
//   "moe_layer-new": ops::moe_experts_shared (the shared expert inside the 2 GEMV launches: 4 launches in all)
// plus "moe_experts-gemv" alone (the routed part, the old bench's number). Bytes: the touched routed experts'
// weights + the shared expert's (2 x Is x H x 2) + activations; GB/s against the 4.2 TB/s floor. Super: the routed
// experts on the latent (1024), the shared expert on the hidden state (4096), as the model runs them. A CHECK line
// compares the new path's outputs with the old one's (routed bit-equal expected, shared close).
void bench_moe_layer_decode(const Context& ctx, const char* model, int64_t E, int64_t k, int64_t D, int64_t I,
                            int64_t H, int64_t Is, float scale) {
  const char* what = "bench moe_layer graph";
  const ExpertsCase ec(model, E, k, D, I, scale);
  const Tensor s_up = random_bf16({Is, H}, 1.7320508f / std::sqrt(static_cast<float>(H)), 23);
  const Tensor s_down = random_bf16({H, Is}, 1.7320508f / std::sqrt(static_cast<float>(Is)), 29);
  for (int64_t T : {1, 2, 4, 8}) {
    ExpertsInputs in = experts_inputs(ec, T, DType::kBF16);
    const Tensor xh = D == H ? in.x : to_dtype(random_f32({T, H}, 1.0f, static_cast<uint32_t>(400 + T)), DType::kBF16);
    Tensor s_out = device::empty(Device::kCuda, DType::kBF16, {T, H});
    Tensor out_old = device::empty(Device::kCuda, DType::kBF16, {T, D});
    Tensor s_out_old = device::empty(Device::kCuda, DType::kBF16, {T, H});
    const double bytes = in.bytes + 2.0 * static_cast<double>(Is * H) * 2.0 + 2.0 * static_cast<double>(T * H) * 2.0;
    const double flops = in.flops + 2.0 * 2.0 * static_cast<double>(T * Is * H);
    const std::string shape = in.shape + " H=" + std::to_string(H) + " Is=" + std::to_string(Is);
    std::printf("INFO moe_layer %s touched_experts=%zu floor_us=%.2f\n", shape.c_str(), in.touched,
                bytes / (kCopyBandwidthGBs * 1e3));
    const auto old_path = [&](cudaStream_t st) {
      const ops::Context c{Device::kCuda, st};
      ops::moe_experts(c, out_old, in.x, in.ids, in.w, ec.up, ec.down);
      ops::relu2_mlp(c, s_out_old, xh, s_up, s_down);
    };
    const auto new_path = [&](cudaStream_t st) {
      const ops::Context c{Device::kCuda, st};
      ops::moe_experts_shared(c, in.out, in.x, in.ids, in.w, ec.up, ec.down, ops::SharedExpert{s_out, xh, s_up, s_down});
    };
    // Outside any capture first: the pointer tables and the cuBLASLt plans are set up on a first call.
    old_path(nullptr);
    new_path(nullptr);
    const Tensor a = device::to_host_f32(in.out), b = device::to_host_f32(out_old);
    const Tensor sa = device::to_host_f32(s_out), sb = device::to_host_f32(s_out_old);
    ctx.run_graph("moe_layer-old", shape, bytes, flops, [&](cudaStream_t st, int) { old_path(st); });
    CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
    ctx.run_graph("moe_layer-new", shape, bytes, flops, [&](cudaStream_t st, int) { new_path(st); });
    CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
    // With its router in front (ops::router_gate_topk on the hidden state, then the experts on its choices, as the
    // model runs them): the shared expert's up units before the up launch's pdl_wait() (the default: they overlap
    // the router) and after it (GemvShared::before_wait); and the down launch's routed first units started before
    // its wait (the default) or after it (GemvFold::early_routed, KernelConfig::moe_down_early).
    {
      const Tensor gate = random_f32({E, H}, 0.05f, static_cast<uint32_t>(500 + T));
      const Tensor bias = random_f32({E}, 0.1f, static_cast<uint32_t>(600 + T));
      Tensor r_ids = device::empty(Device::kCuda, DType::kI32, {T, k});
      Tensor r_w = device::empty(Device::kCuda, DType::kF32, {T, k});
      const ops::RouterParams rp{k, 1, 1, true, scale};
      const auto routed_path = [&](cudaStream_t st, const ops::KernelConfig& kernels) {
        const ops::Context c{Device::kCuda, st, nullptr, kernels};
        ops::router_gate_topk(c, r_ids, r_w, xh, gate, bias, rp);
        ops::moe_experts_shared(c, in.out, in.x, r_ids, r_w, ec.up, ec.down,
                                ops::SharedExpert{s_out, xh, s_up, s_down});
      };
      // "-cluster-off": the default with the router's split-K kernel instead of its single-cluster kernel
      // (KernelConfig::router_cluster; the same kernel where the cluster one does not apply, e.g. Super's gate).
      struct Variant {
        const char* name{};
        bool early_shared{}, down_early{};
        bool router_cluster = true;
      };
      for (const Variant v : {Variant{"moe_layer-router-early", true, true},
                              Variant{"moe_layer-router-early-cluster-off", true, true, false},
                              Variant{"moe_layer-router-late", false, true},
                              Variant{"moe_layer-router-down-late", true, false}}) {
        ops::KernelConfig kernels;
        kernels.moe_early_shared = v.early_shared;
        kernels.moe_down_early = v.down_early;
        kernels.router_cluster = v.router_cluster;
        routed_path(nullptr, kernels);
        ctx.run_graph(v.name, shape, bytes, flops, [&](cudaStream_t st, int) { routed_path(st, kernels); });
        CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
      }
    }
    ctx.run_graph("moe_experts-gemv", in.shape, in.bytes, in.flops, [&](cudaStream_t st, int) {
      cuda::moe::moe_experts_on_path(ops::Context{Device::kCuda, st}, in.out, in.x, in.ids, in.w, ec.up, ec.down,
                                     cuda::moe::ExpertsPath::kGemv);
    });
    CHIMERA_CUDA_CHECK(cudaGetLastError(), what);
    const bool routed_same = std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
    double max_diff = 0, max_ref = 0;
    for (int64_t i = 0; i < sa.numel(); ++i) {
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(sa.f32()[i] - sb.f32()[i])));
      max_ref = std::max(max_ref, static_cast<double>(std::fabs(sb.f32()[i])));
    }
    std::printf("CHECK moe_layer %s routed %s shared max_abs_diff=%.3g max_abs=%.3g %s\n", shape.c_str(),
                routed_same ? "identical" : "DIFFERENT", max_diff, max_ref,
                max_diff <= 2e-2 * std::max(1.0, max_ref) ? "close" : "DIFFERENT");
  }
}

// Nano: hidden 2688, 128 experts top-6, I 1856, shared 3712. Super: hidden 4096, latent 1024, 512 experts top-22,
// I 2688, shared 5376.
CHIMERA_BENCH(moe_layer_decode_nano) { bench_moe_layer_decode(ctx, "nano", 128, 6, 2688, 1856, 2688, 3712, 2.5f); }
CHIMERA_BENCH(moe_layer_decode_super) {
  bench_moe_layer_decode(ctx, "super", 512, 22, 1024, 2688, 4096, 5376, 5.0f);
}

CHIMERA_BENCH(moe_experts_nano) {
  bench_experts(ctx, "nano", 128, 6, 2688, 1856, 2.5f, DType::kBF16, {1, 64, 1024});
}
CHIMERA_BENCH(moe_experts_super) {
  bench_experts(ctx, "super", 512, 22, 1024, 2688, 5.0f, DType::kBF16, {1, 64, 1024});
}
// Prefill: Nano (128 experts top-6, D 2688, I 1856) and Super's latent MoE (512 top-22, D 1024, I 2688).
CHIMERA_BENCH(moe_experts_prefill_nano) {
  bench_experts_prefill(ctx, "nano", 128, 6, 2688, 1856, 2.5f);
}
CHIMERA_BENCH(moe_experts_prefill_super) {
  bench_experts_prefill(ctx, "super", 512, 22, 1024, 2688, 5.0f);
}
CHIMERA_BENCH(moe_experts_decode_nano) { bench_experts_decode(ctx, "nano", 128, 6, 2688, 1856, 2.5f); }
CHIMERA_BENCH(moe_experts_decode_super) { bench_experts_decode(ctx, "super", 512, 22, 1024, 2688, 5.0f); }
// One tensor-parallel rank's routed experts under the two splits over N ranks: by intermediate column ("tensor":
// every rank holds all E experts with I / N of their columns, so every rank does the same work) and by expert
// ("expert": rank r holds experts [r E / N, (r + 1) E / N) whole and runs only the routed pairs that land there,
// after ops::local_expert_ids, so the ranks' work varies with the routing and the step waits for the busiest).
// Both splits end in the same AllReduce of the [T, D] output, which is left out: what differs is the rank's experts
// work, which one GPU measures as well as N (each rank's call timed alone, device time in a CUDA graph). One routing
// per T (the router on random logits, as the other cases here) serves both splits. Lines: "moe_split-tensor" (rank
// 0), "moe_split-expert-r<r>" per rank, and an INFO line with the expert split's slowest and mean rank and
// tensor / slowest (> 1: the expert split is faster).
void bench_split(const Context& ctx, const char* model, int64_t E, int64_t k, int64_t D, int64_t I, float scale) {
  const ops::Context c{Device::kCuda, nullptr};
  for (int64_t N : {2, 4}) {
    const ExpertsCase tensor(model, E, k, D, I / N, scale);
    const ExpertsCase expert(model, E / N, k, D, I, scale);  // one rank's experts (every rank's are alike in size)
    for (int64_t T : {1, 8, 64, 512, 4096}) {
      ExpertsInputs in = experts_inputs(tensor, T, DType::kBF16);
      const std::string shape = std::string(model) + " N=" + std::to_string(N) + " T=" + std::to_string(T) +
                                " (E=" + std::to_string(E) + " k=" + std::to_string(k) + " D=" + std::to_string(D) +
                                " I=" + std::to_string(I) + ")";
      const double t_tensor = ctx.run_graph("moe_split-tensor", shape, in.bytes, in.flops / static_cast<double>(N),
                                            [&](cudaStream_t st, int) {
                                              ops::moe_experts(ops::Context{Device::kCuda, st}, in.out, in.x, in.ids,
                                                               in.w, tensor.up, tensor.down);
                                            });
      double slowest = 0, sum = 0;
      const Tensor host_ids = device::to_host(in.ids);
      for (int64_t r = 0; r < N; ++r) {
        const Tensor ids = device::to_device(host_ids, Device::kCuda);
        ops::local_expert_ids(c, ids, r * (E / N), E / N);
        const Tensor local = device::to_host(ids);
        std::set<int32_t> touched;
        int64_t pairs = 0;
        for (int64_t i = 0; i < local.numel(); ++i) {
          if (local.i32()[i] < 0) continue;
          touched.insert(local.i32()[i]);
          ++pairs;
        }
        const double bytes = static_cast<double>(touched.size()) * 2.0 * static_cast<double>(I * D) * 2.0 +
                             2.0 * static_cast<double>(T * D) * 2.0;
        const double flops = 2.0 * 2.0 * static_cast<double>(pairs) * static_cast<double>(I * D);
        const double t = ctx.run_graph("moe_split-expert-r" + std::to_string(r), shape, bytes, flops,
                                       [&](cudaStream_t st, int) {
                                         ops::moe_experts(ops::Context{Device::kCuda, st}, in.out, in.x, ids, in.w,
                                                          expert.up, expert.down);
                                       });
        slowest = std::max(slowest, t);
        sum += t;
      }
      std::printf("INFO moe_split %s tensor_us=%.2f expert_slowest_us=%.2f expert_mean_us=%.2f "
                  "tensor_over_expert=%.3f\n",
                  shape.c_str(), t_tensor, slowest, sum / static_cast<double>(N), t_tensor / slowest);
    }
  }
}
CHIMERA_BENCH(moe_split_nano) { bench_split(ctx, "nano", 128, 6, 2688, 1856, 2.5f); }
CHIMERA_BENCH(moe_split_super) { bench_split(ctx, "super", 512, 22, 1024, 2688, 5.0f); }

// The fp32-activation path (SIMT, bf16 weights), decode sizes only.
CHIMERA_BENCH(moe_experts_nano_f32x) {
  bench_experts(ctx, "nano", 128, 6, 2688, 1856, 2.5f, DType::kF32, {1, 64});
}

}  // namespace
}  // namespace chimera::bench
