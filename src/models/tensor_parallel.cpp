#include "models/tensor_parallel.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace chimera {
namespace {

bool has_kind(const ModelConfig& c, LayerKind k) {
  return std::find(c.layers.begin(), c.layers.end(), k) != c.layers.end() ||
         (c.num_nextn_predict_layers > 0 &&
          std::find(c.mtp_layers.begin(), c.mtp_layers.end(), k) != c.mtp_layers.end());
}

// n / size, kInvalidInput naming the field when it does not divide.
int64_t divide(int64_t n, const char* field, int size) {
  if (n % size != 0) {
    invalid_input("--tensor-parallel-size {}: config.json {} = {} is not divisible by it", size, field, n);
  }
  return n / size;
}

// n / size, or 1 (replicated) when size is a multiple of n.
int64_t divide_or_replicate(int64_t n, const char* field, int size) {
  if (n % size == 0) return n / size;
  if (size % n == 0) return 1;
  invalid_input("--tensor-parallel-size {}: config.json {} = {} neither divides by it nor divides it", size, field, n);
}

}  // namespace

ModelConfig rank_config(const ModelConfig& config, const TensorParallel& tp) {
  if (tp.size < 1 || tp.rank < 0 || tp.rank >= tp.size) {
    invalid_input("tensor parallelism: rank {} of size {}", tp.rank, tp.size);
  }
  if (tp.size == 1) return config;
  ModelConfig c = config;
  const int n = tp.size;
  c.vocab_size = divide(config.vocab_size, "vocab_size", n);
  if (has_kind(config, LayerKind::kAttention)) {
    c.num_attention_heads = divide(config.num_attention_heads, "num_attention_heads", n);
    c.num_key_value_heads = divide_or_replicate(config.num_key_value_heads, "num_key_value_heads", n);
  }
  if (has_kind(config, LayerKind::kMamba)) {
    c.mamba_num_heads = divide(config.mamba_num_heads, "mamba_num_heads", n);
    c.n_groups = divide_or_replicate(config.n_groups, "n_groups", n);
    // Each rank's heads must share one group when the groups are replicated.
    if (config.mamba_num_heads % config.n_groups != 0) {
      invalid_input("config.json: mamba_num_heads = {} is not a multiple of n_groups = {}", config.mamba_num_heads,
                    config.n_groups);
    }
  }
  if (has_kind(config, LayerKind::kMlp)) c.intermediate_size = divide(config.intermediate_size, "intermediate_size", n);
  if (has_kind(config, LayerKind::kMoe)) {
    if (tp.expert_parallel) {
      divide(config.n_routed_experts, "n_routed_experts", n);  // whole experts per rank; the router sees all of them
    } else {
      c.moe_intermediate_size = divide(config.moe_intermediate_size, "moe_intermediate_size", n);
    }
    c.moe_shared_expert_intermediate_size =
        divide(config.moe_shared_expert_intermediate_size, "moe_shared_expert_intermediate_size", n);
  }
  return c;
}

bool expert_parallel_by_rule(const ModelConfig& config, int size) {
  if (size <= 1 || !has_kind(config, LayerKind::kMoe) || config.n_routed_experts % size != 0) return false;
  if (config.moe_intermediate_size % size != 0) return true;
  return config.moe_intermediate_size / size < kMinExpertSliceColumns;
}

Shape Shard::local_shape(const Shape& full) const {
  if (dim < 0) return full;
  Shape s = full;
  int64_t len = 0;
  for (const auto& [b, e] : ranges) len += e - b;
  s[static_cast<size_t>(dim)] = len;
  return s;
}

std::pair<int64_t, int64_t> even_part(int64_t n, const TensorParallel& tp) {
  const int64_t part = n / tp.size;
  return {tp.rank * part, (tp.rank + 1) * part};
}

std::pair<int64_t, int64_t> split_or_replicate(int64_t n, const TensorParallel& tp) {
  if (n % tp.size == 0) return even_part(n, tp);
  const int64_t i = static_cast<int64_t>(tp.rank) * n / tp.size;
  return {i, i + 1};
}

MambaShard mamba_shard(const ModelConfig& c, const TensorParallel& tp) {
  const int64_t P = c.mamba_head_dim, N = c.ssm_state_size, Di = c.mamba_inner(), GN = c.n_groups * N;
  const auto [h0, h1] = even_part(c.mamba_num_heads, tp);
  const auto [g0, g1] = split_or_replicate(c.n_groups, tp);
  MambaShard s;
  s.heads = {h0, h1};
  s.inner = {h0 * P, h1 * P};
  // in_proj rows: [ z : Di | x : Di | B : G*N | C : G*N | dt : H ] (docs/model.md 3.2).
  s.in_proj = {{h0 * P, h1 * P},
               {Di + h0 * P, Di + h1 * P},
               {2 * Di + g0 * N, 2 * Di + g1 * N},
               {2 * Di + GN + g0 * N, 2 * Di + GN + g1 * N},
               {2 * Di + 2 * GN + h0, 2 * Di + 2 * GN + h1}};
  // conv1d channels: [ x : Di | B : G*N | C : G*N ].
  s.conv = {{h0 * P, h1 * P}, {Di + g0 * N, Di + g1 * N}, {Di + GN + g0 * N, Di + GN + g1 * N}};
  return s;
}

Tensor slice_tensor(const Tensor& full, const Shard& shard, int64_t scale) {
  if (shard.dim < 0) return full;
  const Shape& fs = full.shape();
  const auto d = static_cast<size_t>(shard.dim);
  CHIMERA_CHECK(d < fs.size(), "shard dim {} of a tensor of rank {}", shard.dim, fs.size());
  Shard s = shard;
  for (auto& [b, e] : s.ranges) {
    if (b % scale != 0 || e % scale != 0) {
      invalid_input(
          "tensor parallelism: a shard boundary ({}, {}) is not a multiple of {} (a packed or 16-column "
          "blocked quantized layout)",
          b, e, scale);
    }
    b /= scale;
    e /= scale;
  }
  Tensor out = Tensor::empty(full.dtype(), s.local_shape(fs));
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < d; ++i) outer *= fs[i];
  for (size_t i = d + 1; i < fs.size(); ++i) inner *= fs[i];
  const size_t row = static_cast<size_t>(inner) * dtype_size(full.dtype());
  const auto* in = static_cast<const char*>(full.data());
  auto* o = static_cast<char*>(out.data());
  for (int64_t i = 0; i < outer; ++i) {
    const char* base = in + static_cast<size_t>(i * fs[d]) * row;
    for (const auto& [b, e] : s.ranges) {
      CHIMERA_CHECK(0 <= b && b <= e && e <= fs[d], "shard range [{}, {}) of {}", b, e, fs[d]);
      const size_t bytes = static_cast<size_t>(e - b) * row;
      std::memcpy(o, base + static_cast<size_t>(b) * row, bytes);
      o += bytes;
    }
  }
  return out;
}

}  // namespace chimera
