// Mamba kernels at Nemotron 3 Nano / Super shapes (docs/model.md 9): the selective state update (decode), the
// causal conv1d (prefill and decode update) and the fused decode step (conv update + SSU + gated norm)
// against the three ops it replaces. Bytes are the ones that must move (state read + write, inputs
// read, outputs written), so floor_ratio is the achieved fraction of the measured 4.2 TB/s copy bandwidth.
//
// The launchers are called directly with device-resident metadata (slots, tiles), as the engine's CUDA graphs
// will; "-op" cases go through ops:: (host metadata uploaded every call) for comparison. Small working sets
// would sit in the 60 MB L2 between iterations, so each case rotates over enough disjoint state slots /
// activation buffers to move >= 256 MB per cycle (peers/mamba_peers.py flushes L2 instead).
// Shape strings are shared with peers/mamba_peers.py.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/mamba/conv1d.cuh"
#include "backends/cuda/mamba/mamba_decode_fused.cuh"
#include "backends/cuda/mamba/selective_state_update.cuh"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace chimera::bench {
namespace {

constexpr double kRotateBytes = 256.0 * (1 << 20);

// Uniform [lo, hi) from a hash of the index, generated on the device (states reach 1 GB).
template <typename T>
__global__ void fill_uniform_kernel(T* p, int64_t n, float lo, float hi, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i);  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    p[i] = cuda::from_float<T>(lo + (hi - lo) * static_cast<float>(z >> 40) * (1.0f / (1 << 24)));
  }
}

Tensor random_device(DType dtype, Shape shape, float lo, float hi, uint64_t seed) {
  Tensor t = device::empty(Device::kCuda, dtype, std::move(shape));
  CHIMERA_DISPATCH_FLOAT(dtype, "bench random_device", T, {
    fill_uniform_kernel<T><<<1024, 256>>>(static_cast<T*>(t.data()), t.numel(), lo, hi, seed);
  });
  CHIMERA_LAUNCH_CHECK("bench random_device");
  return t;
}

Tensor device_i32(const std::vector<int32_t>& v) {
  return device::to_device(Tensor::from_i32({static_cast<int64_t>(v.size())}, v), Device::kCuda);
}

int rotation_sets(double bytes_per_call) {
  return std::clamp(static_cast<int>(kRotateBytes / bytes_per_call) + 1, 1, 512);
}

const char* dname(DType d) { return d == DType::kF32 ? "f32" : d == DType::kBF16 ? "bf16" : "f16"; }

// ---- selective state update ---------------------------------------------------------------------------
struct SsuModel {
  const char* name;
  int H, P, N, G;
};
constexpr SsuModel kNano{"nano", 64, 64, 128, 8};
constexpr SsuModel kSuper{"super", 128, 64, 128, 8};

std::string ssu_shape(const SsuModel& m, int batch, DType state) {
  return std::string(m.name) + "_H" + std::to_string(m.H) + "_P" + std::to_string(m.P) + "_N" +
         std::to_string(m.N) + "_G" + std::to_string(m.G) + "_b" + std::to_string(batch) + "_state-" + dname(state) +
         "_act-bf16";
}

// rows_per_warp < 0: through ops:: instead of the launcher.
// graph: also the device time per launch inside a CUDA graph (run_graph).
// persistent: the persistent kernel forced; dynamic_chunk > 0: its dynamic split in chunks of that many units (else
// the static one).
// out_of_place: SsuParams::dst_slots. Each rotation set holds 2 x batch slots, halves A and B; a call reads one half
// and writes the other, and the set's next call goes back (ping-pong, so the state evolves as in place and every
// call reads what an earlier call wrote, as the engine would). The bytes that must move are the same as in place
// (each state read once and written once, to another address), so the rows compare directly with the in-place ones.
void bench_ssu(const Context& ctx, const SsuModel& m, int batch, DType state_dtype, int rows_per_warp,
               const std::string& kernel, bool graph = false, bool persistent = false, int dynamic_chunk = 0,
               bool out_of_place = false) {
  const DType act = DType::kBF16;
  const double state_bytes = 2.0 * batch * m.H * m.P * m.N * static_cast<double>(dtype_size(state_dtype));
  const double act_bytes = (2.0 * batch * m.H * m.P + batch * m.H + 2.0 * batch * m.G * m.N) * dtype_size(act);
  const int sets = rotation_sets(state_bytes + act_bytes);
  const int halves = out_of_place ? 2 : 1;  // slot lists per set (out of place: A and B)
  const int64_t num_slots = static_cast<int64_t>(sets) * halves * batch;
  const Tensor state = random_device(state_dtype, {num_slots, m.H, m.P, m.N}, -1.0f, 1.0f, 1);
  const Tensor x = random_device(act, {batch, m.H, m.P}, -1.0f, 1.0f, 2);
  const Tensor dt = random_device(act, {batch, m.H}, -3.0f, 0.0f, 3);
  const Tensor B = random_device(act, {batch, m.G, m.N}, -1.0f, 1.0f, 4);
  const Tensor C = random_device(act, {batch, m.G, m.N}, -1.0f, 1.0f, 5);
  const Tensor y = device::empty(Device::kCuda, act, {batch, m.H, m.P});
  ops::SsmParams sp;
  sp.A_log = random_device(DType::kF32, {m.H}, 0.0f, 2.0f, 6);
  sp.D = random_device(DType::kF32, {m.H}, -1.0f, 1.0f, 7);
  sp.dt_bias = random_device(DType::kF32, {m.H}, -2.0f, 0.0f, 8);
  // List l (set s = l / halves; out of place: half l % halves) uses slots l * batch .. l * batch + batch - 1,
  // shuffled within the list.
  std::vector<int32_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 gen(9);  // host shuffle of the slot ids
  for (int l = 0; l < sets * halves; ++l) std::shuffle(all.begin() + l * batch, all.begin() + (l + 1) * batch, gen);
  const Tensor slots = device_i32(all);
  // Call i: set i % sets; out of place, it reads half (i / sets) % 2 and writes the other. Offsets into `all`.
  const auto src_list = [&](int i) { return (static_cast<int64_t>(i % sets) * halves + (i / sets) % halves) * batch; };
  const auto dst_list = [&](int i) {
    return (static_cast<int64_t>(i % sets) * halves + (i / sets + 1) % halves) * batch;
  };

  cuda::SsuParams p;
  p.x = x.data(), p.dt_raw = dt.data(), p.B = B.data(), p.C = C.data(), p.y = y.data(), p.state = state.data();
  p.A_log = sp.A_log.data(), p.D = sp.D.data(), p.dt_bias = sp.dt_bias.data();
  p.act = act, p.state_dtype = state_dtype;
  p.dt_min = 0.0f, p.dt_max = std::numeric_limits<float>::infinity();
  p.batch = batch, p.H = m.H, p.P = m.P, p.N = m.N, p.G = m.G;
  p.rows_per_warp = std::max(rows_per_warp, 0);
  if (persistent) {
    p.kernel = cuda::SsuKernel::kPersistent;
    if (dynamic_chunk > 0) p.split = cuda::SsuSplit::kDynamic, p.dynamic_chunk = dynamic_chunk;
  }
  int call = 0;
  const ops::Context octx{Device::kCuda, nullptr};
  ctx.run(kernel, ssu_shape(m, batch, state_dtype), state_bytes + act_bytes, 0.0, [&] {
    const int i = call++;
    if (rows_per_warp < 0) {
      const std::span<const int32_t> host(all.data() + src_list(i), static_cast<size_t>(batch));
      if (out_of_place) {
        const std::span<const int32_t> dst(all.data() + dst_list(i), static_cast<size_t>(batch));
        ops::selective_state_update(octx, y, x, dt, B, C, sp, state, host, dst);
      } else {
        ops::selective_state_update(octx, y, x, dt, B, C, sp, state, host);
      }
    } else {
      p.slots = slots.i32() + src_list(i);
      p.dst_slots = out_of_place ? slots.i32() + dst_list(i) : nullptr;
      cuda::launch_selective_state_update(p, nullptr);
    }
  });
  if (graph && rows_per_warp >= 0) {
    ctx.run_graph(kernel, ssu_shape(m, batch, state_dtype), state_bytes + act_bytes, 0, [&](cudaStream_t st, int i) {
      cuda::SsuParams q = p;
      q.slots = slots.i32() + src_list(i);
      q.dst_slots = out_of_place ? slots.i32() + dst_list(i) : nullptr;
      cuda::launch_selective_state_update(q, st);
    });
  }
}

// F16: the stochastic-rounding store (the same bytes as BF16; the difference is the rounding's hash work).
CHIMERA_BENCH(mamba_ssu) {
  for (const SsuModel* m : {&kSuper, &kNano}) {
    for (DType sd : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (int batch : {1, 8, 64, 256}) bench_ssu(ctx, *m, batch, sd, 0, "ssu", batch >= 64);
    }
  }
}

// The persistent kernel forced next to the grid
// kernel ("ssu" above, same shapes), graph timing.
CHIMERA_BENCH(mamba_ssu_persist) {
  for (const SsuModel* m : {&kSuper, &kNano}) {
    for (DType sd : {DType::kF32, DType::kBF16}) {
      for (int batch : {8, 64, 256}) {
        bench_ssu(ctx, *m, batch, sd, 0, "ssu-persist4k", true, true);
      }
    }
  }
}

// The persistent kernel's dynamic split (batch 64; same bits as ssu-persist4k, the static split, which runs first
// in the same process for comparison), graph timing, batch 64, f32 and bf16 state. Kernel names:
// ssu-p4k-dyn<chunk>[-graph], chunks of 1 / 2 / 4 / 8 units (kAuto takes chunks of 4).
CHIMERA_BENCH(mamba_ssu_persist_sched) {
  for (const SsuModel* m : {&kSuper, &kNano}) {
    for (DType sd : {DType::kF32, DType::kBF16}) {
      for (int batch : {64}) {
        bench_ssu(ctx, *m, batch, sd, 0, "ssu-persist4k", true, true);
        for (int chunk : {1, 2, 4, 8}) {
          bench_ssu(ctx, *m, batch, sd, 0, "ssu-p4k-dyn" + std::to_string(chunk), true, true, chunk);
        }
      }
    }
  }
}

// Out-of-place state write (SsuParams::dst_slots) next to in place, the default kernel choice (kAuto: the persistent
// kernel with the dynamic split at these batches), graph timing: "ssu" / "ssu-graph" in place (as in mamba_ssu),
// "ssu-oop" / "ssu-oop-graph" out of place, same shapes and bytes. The question: does writing the new state to
// another buffer beat the read-modify-write of one (bench/copy_bench.cu's copy_floor: 0.712 in place vs 0.832 into
// another buffer of the 4.2 TB/s)?
CHIMERA_BENCH(mamba_ssu_oop) {
  for (const SsuModel* m : {&kSuper, &kNano}) {
    for (DType sd : {DType::kF32, DType::kBF16}) {
      for (int batch : {64, 256}) {
        bench_ssu(ctx, *m, batch, sd, 0, "ssu", true);
        bench_ssu(ctx, *m, batch, sd, 0, "ssu-oop", true, false, 0, /*out_of_place=*/true);
      }
    }
  }
}

// Row tilings of the fast kernel and the ops:: path.
CHIMERA_BENCH(mamba_ssu_variants) {
  for (DType sd : {DType::kF32, DType::kBF16}) {
    for (int batch : {1, 8, 64, 256}) {
      for (int rows : {4, 8, 16}) bench_ssu(ctx, kSuper, batch, sd, rows, "ssu-rpw" + std::to_string(rows));
    }
    bench_ssu(ctx, kSuper, 64, sd, -1, "ssu-op");
  }
}

// ---- causal conv1d -------------------------------------------------------------------------------------
constexpr int kConvDim = 10240;  // Super: Di + 2 * G * N
constexpr int kConvK = 4;

// The tile kernel as the ops:: adapter launches it.
void bench_conv_prefill(const Context& ctx, int n_seqs, int seq_len) {
  const std::string kernel = "conv1d-prefill";
  const DType act = DType::kBF16;
  const int64_t T = static_cast<int64_t>(n_seqs) * seq_len, C = kConvDim;
  const double bytes = 2.0 * T * C * dtype_size(act) + 2.0 * n_seqs * C * (kConvK - 1) * dtype_size(act) +
                       C * (kConvK + 1) * 2.0;
  const int sets = rotation_sets(bytes);
  const Tensor x = random_device(act, {sets * T, C}, -1.0f, 1.0f, 11);
  const Tensor out = device::empty(Device::kCuda, act, {sets * T, C});
  const Tensor w = random_device(DType::kBF16, {C, 1, kConvK}, -0.5f, 0.5f, 12);
  const Tensor bias = random_device(DType::kBF16, {C}, -0.5f, 0.5f, 13);
  const Tensor state = random_device(act, {static_cast<int64_t>(sets) * n_seqs, C, kConvK - 1}, -1.0f, 1.0f, 14);
  // One tile list per set (rows of set s start at s * T, slots at s * n_seqs).
  std::vector<Tensor> tiles;
  int n_tiles = 0;
  for (int s = 0; s < sets; ++s) {
    std::vector<int32_t> cu = {0}, slots;
    for (int i = 0; i < n_seqs; ++i) cu.push_back(cu.back() + seq_len), slots.push_back(s * n_seqs + i);
    std::vector<cuda::Conv1dTile> t = cuda::conv1d_tiles(cu, slots);
    std::vector<int32_t> flat;
    for (const cuda::Conv1dTile& tile : t) {
      flat.insert(flat.end(), {tile.row_begin + static_cast<int32_t>(s * T), tile.len, tile.t0, tile.slot});
    }
    n_tiles = static_cast<int>(t.size());
    const Tensor d = device_i32(flat);
    tiles.push_back(d);
  }
  cuda::Conv1dParams p;
  p.x = x.data(), p.out = out.data(), p.weight = w.data(), p.bias = bias.data(), p.conv_state = state.data();
  p.act = act, p.weight_dtype = DType::kBF16, p.bias_dtype = DType::kBF16, p.state_dtype = act;
  p.C = C, p.K = kConvK, p.silu = true, p.n_tiles = n_tiles;
  int call = 0;
  const std::string shape = "super_C" + std::to_string(C) + "_K4_T" + std::to_string(T) + "_seqs" +
                            std::to_string(n_seqs) + "_act-bf16";
  ctx.run(kernel, shape, bytes, 0.0, [&] {
    p.tiles = reinterpret_cast<const cuda::Conv1dTile*>(tiles[static_cast<size_t>(call++ % sets)].data());
    cuda::launch_causal_conv1d(p, nullptr);
  });
  ctx.run_graph(kernel, shape, bytes, 0, [&](cudaStream_t st, int i) {
    cuda::Conv1dParams q = p;
    q.tiles = reinterpret_cast<const cuda::Conv1dTile*>(tiles[static_cast<size_t>(i % sets)].data());
    cuda::launch_causal_conv1d(q, st);
  });
}

void bench_conv_update(const Context& ctx, int batch) {
  const DType act = DType::kBF16;
  const int64_t C = kConvDim;
  const double bytes = 2.0 * batch * C * dtype_size(act) + 2.0 * batch * C * (kConvK - 1) * dtype_size(act) +
                       C * (kConvK + 1) * 2.0;
  const int sets = rotation_sets(bytes);
  const Tensor x = random_device(act, {static_cast<int64_t>(sets) * batch, C}, -1.0f, 1.0f, 21);
  const Tensor out = device::empty(Device::kCuda, act, {static_cast<int64_t>(sets) * batch, C});
  const Tensor w = random_device(DType::kBF16, {C, 1, kConvK}, -0.5f, 0.5f, 22);
  const Tensor bias = random_device(DType::kBF16, {C}, -0.5f, 0.5f, 23);
  const Tensor state = random_device(act, {static_cast<int64_t>(sets) * batch, C, kConvK - 1}, -1.0f, 1.0f, 24);
  std::vector<int32_t> all(static_cast<size_t>(sets) * batch);
  std::iota(all.begin(), all.end(), 0);
  const Tensor slots = device_i32(all);
  cuda::Conv1dParams p;
  p.weight = w.data(), p.bias = bias.data(), p.conv_state = state.data();
  p.act = act, p.weight_dtype = DType::kBF16, p.bias_dtype = DType::kBF16, p.state_dtype = act;
  p.C = C, p.K = kConvK, p.silu = true, p.batch = batch;
  const std::string kernel = "conv1d-update";
  int call = 0;
  const std::string shape = "super_C" + std::to_string(C) + "_K4_b" + std::to_string(batch) + "_act-bf16";
  ctx.run(kernel, shape, bytes, 0.0, [&] {
    const int64_t set = call++ % sets;
    p.x = static_cast<const char*>(x.data()) + set * batch * C * dtype_size(act);
    p.out = static_cast<char*>(out.data()) + set * batch * C * dtype_size(act);
    p.slots = slots.i32() + set * batch;
    cuda::launch_causal_conv1d_update(p, nullptr);
  });
  ctx.run_graph(kernel, shape, bytes, 0, [&](cudaStream_t st, int i) {
    const int64_t set = i % sets;
    cuda::Conv1dParams q = p;
    q.x = static_cast<const char*>(x.data()) + set * batch * C * dtype_size(act);
    q.out = static_cast<char*>(out.data()) + set * batch * C * dtype_size(act);
    q.slots = slots.i32() + set * batch;
    cuda::launch_causal_conv1d_update(q, st);
  });
}

// Prefix caching's cost in the conv (ops::causal_conv1d, host plan included, as the model calls it): one
// prompt of T tokens with a checkpoint every `spacing` tokens (none: 0), each writing the K-1 inputs before its cut
// to a slot of its own. Bytes: the plain call's plus each checkpoint's window.
void bench_conv_checkpoints(const Context& ctx, const char* model, int64_t C, int32_t T, int32_t spacing) {
  const DType act = DType::kBF16;
  const std::vector<ops::StateCheckpoint> cuts = checkpoints_every(T, spacing);
  const int64_t n_cuts = static_cast<int64_t>(cuts.size());
  const double window = static_cast<double>(C) * (kConvK - 1) * dtype_size(act);
  const double bytes = 2.0 * T * C * dtype_size(act) + 2.0 * window + C * (kConvK + 1) * 2.0 + n_cuts * window;
  const Tensor x = random_device(act, {T, C}, -1.0f, 1.0f, 41);
  const Tensor out = device::empty(Device::kCuda, act, {T, C});
  const Tensor w = random_device(DType::kBF16, {C, 1, kConvK}, -0.5f, 0.5f, 42);
  const Tensor bias = random_device(DType::kBF16, {C}, -0.5f, 0.5f, 43);
  const Tensor state = random_device(act, {1 + n_cuts, C, kConvK - 1}, -1.0f, 1.0f, 44);
  const std::vector<int32_t> cu = {0, T}, slots = {0};
  const ops::Context octx{Device::kCuda, nullptr};
  const std::string shape = std::string(model) + "_C" + std::to_string(C) + "_K4_T" + std::to_string(T) +
                            "_act-bf16_checkpoints" + std::to_string(n_cuts) +
                            (spacing > 0 ? "_every" + std::to_string(spacing) : "");
  ctx.run("conv1d-prefill-checkpoints", shape, bytes, 0.0,
          [&] { ops::causal_conv1d(octx, out, x, w, bias, state, cu, slots, true, cuts); });
}

// At Nano (C = 64 x 64 + 2 x 8 x 128) and Super (C = 10240) widths, 8K tokens: none, every 2048 (the default
// spacing), every 512.
CHIMERA_BENCH(mamba_conv1d_checkpoints) {
  for (int32_t spacing : {0, 2048, 512}) bench_conv_checkpoints(ctx, "nano", 6144, 8192, spacing);
  for (int32_t spacing : {0, 2048, 512}) bench_conv_checkpoints(ctx, "super", kConvDim, 8192, spacing);
}

CHIMERA_BENCH(mamba_conv1d) {
  for (int tokens : {1024, 8192, 32768}) bench_conv_prefill(ctx, 1, tokens);
  bench_conv_prefill(ctx, 8, 1024);
  for (int batch : {1, 64, 256}) bench_conv_update(ctx, batch);
}

// ---- fused decode step: conv update + SSU + gated norm vs the three ops -----------------------------------
// Both inside a CUDA graph (the decode path): "mamba-decode-fused" is ONE kernel from the in_proj rows;
// "mamba-decode-3ops" is the model's unfused path, column splits included (views at batch 1, copies otherwise).
// Bytes: SSM state and conv state read + written, the in_proj rows read, out written (weights are negligible).
void bench_mamba_decode(const Context& ctx, const SsuModel& m, int batch, DType state_dtype) {
  const DType act = DType::kBF16;
  const int64_t Di = int64_t{m.H} * m.P, Cd = Di + 2 * int64_t{m.G} * m.N, K = 4, width = Di + Cd + m.H;
  const double ssm_bytes = 2.0 * batch * m.H * m.P * m.N * static_cast<double>(dtype_size(state_dtype));
  const double conv_bytes = 2.0 * batch * Cd * (K - 1) * dtype_size(act);
  const double act_bytes = static_cast<double>(batch) * (width + Di) * dtype_size(act);
  const double bytes = ssm_bytes + conv_bytes + act_bytes;
  const int sets = rotation_sets(bytes);
  const int64_t num_slots = static_cast<int64_t>(sets) * batch;
  const Tensor ssm_state = random_device(state_dtype, {num_slots, m.H, m.P, m.N}, -1.0f, 1.0f, 31);
  const Tensor conv_state = random_device(act, {num_slots, Cd, K - 1}, -1.0f, 1.0f, 32);
  const Tensor zxbcdt = random_device(act, {batch, width}, -1.0f, 1.0f, 33);
  const Tensor conv_w = random_device(act, {Cd, 1, K}, -0.5f, 0.5f, 34);
  const Tensor conv_b = random_device(act, {Cd}, -0.5f, 0.5f, 35);
  const Tensor norm_w = random_device(act, {Di}, 0.8f, 1.2f, 36);
  const Tensor out = device::empty(Device::kCuda, act, {batch, Di});
  ops::SsmParams sp;
  sp.A_log = random_device(DType::kF32, {m.H}, 0.0f, 2.0f, 37);
  sp.D = random_device(DType::kF32, {m.H}, -1.0f, 1.0f, 38);
  sp.dt_bias = random_device(DType::kF32, {m.H}, -2.0f, 0.0f, 39);
  std::vector<int32_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 gen(40);
  for (int s = 0; s < sets; ++s) std::shuffle(all.begin() + s * batch, all.begin() + (s + 1) * batch, gen);
  const Tensor slots = device_i32(all);
  const auto set_slots = [&](int i) {
    const size_t off = static_cast<size_t>(i % sets) * batch;
    return ops::Indices(std::span<const int32_t>(all.data() + off, static_cast<size_t>(batch)), slots.i32() + off);
  };
  const std::string shape = ssu_shape(m, batch, state_dtype) + "_K4";
  const float eps = 1e-5f;

  cuda::MambaDecodeParams probe;
  probe.ssm_state = ssm_state.data(), probe.act = act, probe.conv_state_dtype = act;
  probe.ssm_state_dtype = state_dtype, probe.batch = batch, probe.H = m.H, probe.P = m.P, probe.N = m.N;
  probe.G = m.G, probe.K = static_cast<int>(K);
  const int cluster = cuda::mamba_decode_fused_cluster(probe);
  std::printf("INFO mamba-decode-fused %s cluster=%d (0: the op composes the three ops)\n", shape.c_str(), cluster);

  ops::KernelConfig fused_kernels;  // the fused kernel at every batch (the plan takes it for the smallest only)
  fused_kernels.mamba_decode_fused_max_rows = batch;
  const double fused_us = ctx.run_graph("mamba-decode-fused", shape, bytes, 0, [&](cudaStream_t st, int i) {
    ops::mamba_decode_update(ops::Context{Device::kCuda, st, nullptr, fused_kernels}, out, zxbcdt, conv_w, conv_b, sp, norm_w, m.G, eps,
                             conv_state, ssm_state, set_slots(i));
  });
  const double three_us = ctx.run_graph("mamba-decode-3ops", shape, bytes, 0, [&](cudaStream_t st, int i) {
    const ops::Context c{Device::kCuda, st};
    const int64_t B = batch, GN = int64_t{m.G} * m.N;
    Tensor z, xbc, dt, x, Bm, Cm;
    const Tensor xbc_act = device::empty(Device::kCuda, act, {B, Cd});
    if (B == 1) {  // the model's split_columns: views of one row
      const Tensor row = zxbcdt.reshape({width});
      z = row.rows(0, Di).reshape({1, Di}), xbc = row.rows(Di, Di + Cd).reshape({1, Cd});
      dt = row.rows(Di + Cd, width).reshape({1, m.H});
    } else {
      z = device::empty(Device::kCuda, act, {B, Di}), xbc = device::empty(Device::kCuda, act, {B, Cd});
      dt = device::empty(Device::kCuda, act, {B, m.H});
      ops::copy_columns(c, z, zxbcdt, 0), ops::copy_columns(c, xbc, zxbcdt, Di);
      ops::copy_columns(c, dt, zxbcdt, Di + Cd);
    }
    ops::causal_conv1d_update(c, xbc_act, xbc, conv_w, conv_b, conv_state, set_slots(i), true);
    if (B == 1) {
      const Tensor row = xbc_act.reshape({Cd});
      x = row.rows(0, Di).reshape({1, Di}), Bm = row.rows(Di, Di + GN).reshape({1, GN});
      Cm = row.rows(Di + GN, Cd).reshape({1, GN});
    } else {
      x = device::empty(Device::kCuda, act, {B, Di}), Bm = device::empty(Device::kCuda, act, {B, GN});
      Cm = device::empty(Device::kCuda, act, {B, GN});
      ops::copy_columns(c, x, xbc_act, 0), ops::copy_columns(c, Bm, xbc_act, Di);
      ops::copy_columns(c, Cm, xbc_act, Di + GN);
    }
    const Tensor y = device::empty(Device::kCuda, act, {B, m.H, m.P});
    ops::selective_state_update(c, y, x.reshape({B, m.H, m.P}), dt, Bm.reshape({B, m.G, m.N}),
                                Cm.reshape({B, m.G, m.N}), sp, ssm_state, set_slots(i));
    ops::gated_rms_norm(c, out, y.reshape({B, Di}), z, norm_w, m.G, eps);
  });
  std::printf("RATIO mamba-decode %s fused_us=%.2f three_ops_us=%.2f speedup=%.2fx\n", shape.c_str(), fused_us,
              three_us, three_us / fused_us);
}

CHIMERA_BENCH(mamba_decode_fused) {
  for (const SsuModel* m : {&kNano, &kSuper}) {
    for (DType sd : {DType::kF32, DType::kBF16}) {
      for (int batch : {1, 8, 64, 256}) bench_mamba_decode(ctx, *m, batch, sd);
    }
  }
}

}  // namespace
}  // namespace chimera::bench
