// Tensor parallelism of a Nemotron-H model (docs/architecture.md "Tensor parallelism"): which rank this model is,
// the rank-local view of the config (the heads, groups, intermediate columns and vocabulary rows the rank holds),
// and where a rank's shard of each weight lies in the full tensor (the name table's shard column,
// models/nemotron_h_weights.h). Plain index arithmetic: no communication here (dist/host_group.h does that).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "io/model_config.h"

namespace chimera {

struct TensorParallel {
  int rank = 0;
  int size = 1;
  // How the routed experts split: false, by their intermediate dimension (tensor parallel: every rank holds a
  // slice of every expert); true, by expert (expert parallel: rank r holds experts [r E / size, (r + 1) E / size)
  // whole and runs only the (token, expert) pairs that fall on them). The rest of the model is the same either way.
  bool expert_parallel = false;
  bool enabled() const { return size > 1; }
  // Rank r of the same split.
  TensorParallel with_rank(int r) const { return {r, size, expert_parallel}; }
};

// How --moe-split auto splits the routed experts over `size` ranks (TensorParallel::expert_parallel): by expert
// when splitting by intermediate column would leave every expert slice narrower than kMinExpertSliceColumns (the
// expert GEMMs / GEMVs then lose more to their narrow width than the expert split loses to its uneven load: the
// busiest rank runs more than its share of the routed pairs), or when n_routed_experts divides by size and
// moe_intermediate_size does not; by intermediate column otherwise. A model without routed experts: false.
// docs/perf.md "Tensor parallelism: splitting the routed experts" has the measurement behind the threshold.
inline constexpr int64_t kMinExpertSliceColumns = 768;
bool expert_parallel_by_rule(const ModelConfig& config, int size);

// The config as rank tp.rank of tp.size sees it; what the forward sizes its activations by and what the rank's
// StateCache is made from (it then holds only the rank's KV heads and Mamba heads):
//   num_attention_heads / size; num_key_value_heads / size, or 1 when ranks outnumber the KV heads (each rank keeps
//   the KV head of its query heads: replicated); mamba_num_heads / size; n_groups / size, or 1 when ranks outnumber
//   the groups (replicated: the group of the rank's heads); intermediate_size, moe_intermediate_size and
//   moe_shared_expert_intermediate_size / size (moe_intermediate_size whole with expert_parallel, which needs
//   n_routed_experts / size); vocab_size / size (vocabulary-parallel embeddings and lm_head).
// Everything else (hidden_size, experts, router, head_dim, ...) is unchanged. Only the fields of the layer kinds
// the model has (backbone and MTP head) are divided. A size that does not split is kInvalidInput naming the
// config field; tp.size == 1 returns `config` unchanged.
ModelConfig rank_config(const ModelConfig& config, const TensorParallel& tp);

// A rank's shard of one tensor: along dimension `dim` the concatenation of the full tensor's index ranges
// [begin, end) in `ranges`; dim < 0: replicated (the whole tensor). rank0_only: a row-parallel layer's bias,
// added once after the sum (rank 0 keeps it, the other ranks none).
struct Shard {
  int dim = -1;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  bool rank0_only = false;
  bool replicated() const { return dim < 0 && !rank0_only; }
  // `full` with dimension dim replaced by the ranges' total length.
  Shape local_shape(const Shape& full) const;
};

// The rank's part [begin, end) of n items split evenly.
std::pair<int64_t, int64_t> even_part(int64_t n, const TensorParallel& tp);
// The rank's part of n items that may be replicated: n / size items when n % size == 0, else (size % n == 0) the
// one item that the rank's part of the heads maps to, [r * n / size, +1).
std::pair<int64_t, int64_t> split_or_replicate(int64_t n, const TensorParallel& tp);

// Shard rules (ranges in the full tensor's rows / columns) of the Mamba-2 and attention layers.
struct MambaShard {
  std::vector<std::pair<int64_t, int64_t>> in_proj;  // [ z | x | B | C | dt ] rows of the rank's heads and groups
  std::vector<std::pair<int64_t, int64_t>> conv;     // [ x | B | C ] channels
  std::pair<int64_t, int64_t> heads;                 // A_log, D, dt_bias
  std::pair<int64_t, int64_t> inner;                 // norm weight, out_proj columns: heads x mamba_head_dim
};
MambaShard mamba_shard(const ModelConfig& config, const TensorParallel& tp);

// A host tensor's shard (a contiguous copy; the tensor itself when the shard is replicated). Any dtype of whole
// bytes; `scale` divides the ranges (a packed or blocked layout: NVFP4's two values a byte, its 16-column block
// scales), each range boundary must be a multiple of it.
Tensor slice_tensor(const Tensor& full, const Shard& shard, int64_t scale = 1);

}  // namespace chimera
