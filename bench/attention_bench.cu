// Attention benchmarks at Nemotron 3 Nano / Super shapes (docs/model.md 9: 32 q heads, 2 kv heads, head_dim
// 128), bf16 activations and KV cache, paged cache with 64-token blocks in shuffled order.
//   prefill: one sequence of 1K / 8K / 32K tokens (append + causal prefill) -> TFLOP/s of the causal
//            attention (4 * hd * Qh * T(T+1)/2 useful FLOPs).
//   decode:  batch 1 / 8 / 64 / 256, one new token over 1K / 8K cached tokens -> GB/s of the KV read
//            (B * (ctx + 1) * KVh * hd * 2 (k and v) * 2 bytes, plus q, out and the appended row); at B <= 8 also
//            the device time inside a CUDA graph (device-side metadata, as a captured decode step).
// bench/peers/attention_peers.py times torch SDPA (flash backend, dense KV) on the same shapes.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/attention/attention_kernels.cuh"
#include "backends/cuda/cuda_ops.h"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "ops/ops.h"

namespace chimera::bench {
namespace {

constexpr int64_t kQh = 32, kKVh = 2, kHd = 128, kBlock = 64;

// Uniform values in [-1, 1) from a hash of the index: fresh, non-zero data without a host round trip.
__global__ void fill_random_kernel(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    p[i] = __float2bfloat16_rn(static_cast<float>(h) * (2.0f / 4294967296.0f) - 1.0f);
  }
}

Tensor random_bf16(Shape shape, uint32_t seed) {
  Tensor t = device::empty(Device::kCuda, DType::kBF16, std::move(shape));
  fill_random_kernel<<<1024, 256>>>(t.data_as<__nv_bfloat16>(), t.numel(), seed);
  return t;
}

// Block tables for `lens` tokens per sequence: every block id used once, in shuffled order.
Tensor shuffled_tables(const std::vector<int64_t>& lens, int64_t& num_blocks) {
  int64_t max_blocks = 0;
  for (int64_t n : lens) max_blocks = std::max(max_blocks, (n + kBlock - 1) / kBlock);
  num_blocks = int64_t(lens.size()) * max_blocks;
  std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(1234));
  return device::to_device(Tensor::from_i32({int64_t(lens.size()), max_blocks}, ids), Device::kCuda);
}

std::string heads_text() { return "Qh=32 KVh=2 hd=128 bf16 block=64"; }

void bench_prefill(const Context& ctx, int64_t T) {
  int64_t num_blocks = 0;
  const Tensor tables = shuffled_tables({T}, num_blocks);
  const ops::KvCacheView cache{random_bf16({num_blocks, kBlock, kKVh, kHd}, 1),
                               random_bf16({num_blocks, kBlock, kKVh, kHd}, 2)};
  const Tensor q = random_bf16({T, kQh, kHd}, 3), k = random_bf16({T, kKVh, kHd}, 4), v = random_bf16({T, kKVh, kHd}, 5);
  const Tensor out = device::empty(Device::kCuda, DType::kBF16, {T, kQh, kHd});
  const std::vector<int32_t> cu = {0, int32_t(T)}, ctx_lens = {0};
  const ops::Context c{Device::kCuda, nullptr};
  const double flops = 4.0 * kHd * kQh * (double(T) * (T + 1) / 2);
  const double bytes = double(T) * kHd * 2 * (2 * kQh + 4 * kKVh);  // q, out; k, v read and appended
  ctx.run("attention_prefill", "T=" + std::to_string(T) + " " + heads_text(), bytes, flops,
          [&] { ops::attention(c, out, q, k, v, cache, cu, ctx_lens, tables, 1.0f / std::sqrt(float(kHd))); });
}

void bench_decode(const Context& ctx, int64_t B, int64_t context) {
  int64_t num_blocks = 0;
  const Tensor tables = shuffled_tables(std::vector<int64_t>(size_t(B), context + 1), num_blocks);
  const ops::KvCacheView cache{random_bf16({num_blocks, kBlock, kKVh, kHd}, 11),
                               random_bf16({num_blocks, kBlock, kKVh, kHd}, 12)};
  const Tensor q = random_bf16({B, kQh, kHd}, 13), k = random_bf16({B, kKVh, kHd}, 14), v = random_bf16({B, kKVh, kHd}, 15);
  const Tensor out = device::empty(Device::kCuda, DType::kBF16, {B, kQh, kHd});
  std::vector<int32_t> cu(static_cast<size_t>(B) + 1), ctx_lens(static_cast<size_t>(B), static_cast<int32_t>(context));
  std::iota(cu.begin(), cu.end(), 0);
  const ops::Context c{Device::kCuda, nullptr};
  const double kv_bytes = double(B) * (context + 1) * kKVh * kHd * 2 * 2;
  const double bytes = kv_bytes + double(B) * kHd * 2 * (2 * kQh + 2 * kKVh);
  const std::string shape = "B=" + std::to_string(B) + " ctx=" + std::to_string(context) + " " + heads_text();
  ctx.run("attention_decode", shape, bytes, 0.0,
          [&] { ops::attention(c, out, q, k, v, cache, cu, ctx_lens, tables, 1.0f / std::sqrt(float(kHd))); });
  if (B <= 8) {
    // Inside a CUDA graph with device-side metadata, as a captured decode step runs it (decode with the append
    // folded in, the split merge; splits planned for the block table's capacity).
    const Tensor cu_dev = device::to_device(Tensor::from_i32({B + 1}, cu), Device::kCuda);
    const Tensor ctx_dev = device::to_device(Tensor::from_i32({B}, ctx_lens), Device::kCuda);
    const ops::Indices cu_idx(cu, cu_dev.i32()), ctx_idx(ctx_lens, ctx_dev.i32());
    std::vector<Tensor> outs;
    ctx.run_graph("attention_decode", shape, bytes, 0.0, [&](cudaStream_t st, int) {
      ops::attention(ops::Context{Device::kCuda, st}, out, q, k, v, cache, cu_idx, ctx_idx, tables,
                     1.0f / std::sqrt(float(kHd)));
    });
    outs.push_back(device::to_host_f32(out));
    // The append as its own launch (KernelConfig::attention_decode_append off) against the default, folded into the
    // decode kernel; CHECK: the same bits.
    ops::Context separate_ctx{Device::kCuda, nullptr};
    separate_ctx.kernels.attention_decode_append = false;
    ctx.run_graph("attention_decode-append-launch", shape, bytes, 0.0, [&](cudaStream_t st, int) {
      separate_ctx.stream = st;
      ops::attention(separate_ctx, out, q, k, v, cache, cu_idx, ctx_idx, tables, 1.0f / std::sqrt(float(kHd)));
    });
    const Tensor separate = device::to_host_f32(out);
    const bool same = std::memcmp(separate.f32(), outs[0].f32(), static_cast<size_t>(separate.nbytes())) == 0;
    std::printf("CHECK attention_decode %s append-folded-vs-launch %s\n", shape.c_str(),
                same ? "bit-identical" : "DIFFERENT");
  }
}

}  // namespace

CHIMERA_BENCH(attention_prefill) {
  for (int64_t T : {1024, 8192, 32768}) bench_prefill(ctx, T);
}

CHIMERA_BENCH(attention_decode) {
  for (int64_t context : {1024, 8192}) {
    for (int64_t B : {1, 8, 64, 256}) bench_decode(ctx, B, context);
  }
}

}  // namespace chimera::bench
