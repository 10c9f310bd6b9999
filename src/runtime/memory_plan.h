// The memory plan: what a model needs on its device, from the config and the serving limits alone, checked
// before anything is allocated so that a model that cannot fit fails at once with the numbers.
//   weights     every parameter in the weight dtype; A_log, D, dt_bias, the router gate and its correction
//               bias in fp32 (how NemotronH keeps them on CUDA)
//   KV cache    attention layers x 2 (K, V) x kv heads x head_dim x activation dtype (1 byte with an FP8 cache),
//               for max_num_seqs
//               sequences of max_model_len tokens rounded up to whole blocks, plus one block per CUDA-graph pad row
//   Mamba state per Mamba layer and sequence (and CUDA-graph pad row, and prefix-caching checkpoint): conv state
//   [conv_dim, conv_kernel - 1] in the
//               activation dtype and SSM state [mamba_num_heads, mamba_head_dim, ssm_state_size] in
//               MemoryLimits::ssm_dtype (fp32 unless --mamba-ssm-cache-dtype says otherwise)
//   workspace   an estimate: per token of a step, a few hidden-size activations plus the widest mixer's
//               intermediates; plus fp32 logits rows for every sequence
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "core/dtype.h"
#include "io/model_config.h"
#include "ops/quant_weights.h"

namespace chimera {

struct MemoryLimits {
  int32_t max_num_seqs = 1;
  int32_t max_model_len = 4096;
  int32_t max_tokens_per_step = 2048;  // SchedulerConfig::max_num_batched_tokens
  int32_t block_size = 16;             // KV tokens per block (CacheSizes::block_size)
  int32_t graph_pad_rows = 0;          // scratch Mamba slots and KV blocks of CUDA-graph pad rows (CacheSizes::num_pad)
  DType ssm_dtype = DType::kF32;       // the SSM state's dtype (CacheSizes::ssm_dtype)
  bool kv_cache_fp8 = false;           // K / V in FP8 E4M3, one byte an element (CacheSizes::kv_cache_fp8)
  int32_t mamba_checkpoints = 0;       // prefix caching's Mamba checkpoint slots (CacheSizes::checkpoint_slots)
};

struct MemoryPlan {
  size_t weights = 0;
  size_t kv_cache = 0;
  size_t mamba_state = 0;
  size_t workspace = 0;
  int32_t mamba_checkpoints = 0;  // of the Mamba state, this many prefix-caching checkpoints (named in the error)
  size_t total() const { return weights + kv_cache + mamba_state + workspace; }
};

// Parameters by kind ("embeddings", "mamba", ..., "lm_head"), from the config alone (checked arithmetic, as
// plan_memory): equal to
// NemotronH::parameter_counts() of a model of this config without its "mtp" entry (the MTP head, when it has one,
// is not counted here: the batch-1 roofline and the published parameter counts are the backbone's).
std::map<std::string, int64_t> parameter_counts(const ModelConfig& config);
// Parameters of the config's layers, embeddings, norm_f and lm_head (no MTP head); equals the sum of
// NemotronH::parameter_counts() for a model of this config.
int64_t parameter_count(const ModelConfig& config);
// Of those, the ones NemotronH keeps in fp32 on CUDA (A_log, D, dt_bias, router gate, correction bias).
int64_t fp32_parameter_count(const ModelConfig& config);

// Weight bytes by kind ("embeddings", "mamba", ..., "lm_head") when every linear layer but lm_head is stored as
// `linear_format` (what --quantization does at load: FP8 1 byte a weight + its F32 weight_scale; NVFP4 half a byte
// a weight + one e4m3 block scale per 16 + its F32 weight_scale_2), everything else in weight_dtype, and the fp32
// parameters (fp32_parameter_count) in fp32. kDense: every linear layer in weight_dtype too.
std::map<std::string, int64_t> weight_bytes(const ModelConfig& config, DType weight_dtype,
                                            ops::WeightFormat linear_format);

// weight_dtype: the dtype weights are stored in; act_dtype: activations, conv state and KV cache; linear_format: how
// the linear layers are stored (weight_bytes). Every size is
// computed with checked int64 arithmetic: one that overflows (e.g. 2^31 sequences of 2^31 tokens) is
// kInvalidInput naming the part, so total() is never a wrapped, too small number.
MemoryPlan plan_memory(const ModelConfig& config, DType weight_dtype, DType act_dtype, const MemoryLimits& limits,
                       ops::WeightFormat linear_format = ops::WeightFormat::kDense);

// "12.34 GiB"
std::string gib(size_t bytes);
// Throws kInvalidInput when the plan does not fit in `free_bytes` of `device_name` ("GPU", "host"):
// "needs X GiB (weights A, KV B, Mamba state C, workspace D) but the GPU has Y GiB free".
void check_memory_plan(const MemoryPlan& plan, size_t free_bytes, const std::string& device_name);

}  // namespace chimera
