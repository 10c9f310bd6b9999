// The batch-1 decode roofline: one token at batch 1 must read every active weight once, so
//   tokens/s <= bandwidth / (bytes of the weights one token reads).
// Active parameters come from the config alone: every layer's weights, the routed experts counted as top-k of
// E (the router picks num_experts_per_tok of n_routed_experts per token), the embeddings and the lm_head.
// Bytes read per token differ from active x dtype in two places: the embedding table is indexed (one row is
// read, not vocab_size rows), and the fp32-kept parameters (A_log, D, dt_bias, router gate and bias; see
// memory_plan.h) cost 4 bytes each. State traffic (Mamba state, KV cache) is left out: at batch 1 and short
// contexts it is small beside the weights; at large batch it is not (docs/perf.md, "Method and floors").
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "io/model_config.h"

namespace chimera {

// The H200's measured device-to-device copy bandwidth (docs/perf.md, "Method and floors": 4.21 TB/s, read + write).
constexpr double kH200MeasuredBandwidth = 4.2e12;  // bytes/s

// Parameters one token uses: parameter_count(config) with each MoE layer's routed experts scaled by top-k / E.
int64_t active_parameter_count(const ModelConfig& config);

struct DecodeRoofline {
  int64_t active_params = 0;   // active_parameter_count(config), embeddings included
  int64_t params_read = 0;     // of those, the ones a decode token reads (one embedding row, not the table)
  double bytes_per_token = 0;  // weight bytes one decode token reads
  double bandwidth = 0;        // bytes/s
  double tokens_per_s = 0;     // bandwidth / bytes_per_token
};

// Weights in `weight_dtype` (the fp32-kept parameters in fp32) streamed at `bandwidth` bytes/s.
DecodeRoofline batch1_decode_roofline(const ModelConfig& config, DType weight_dtype,
                                      double bandwidth = kH200MeasuredBandwidth);

}  // namespace chimera
