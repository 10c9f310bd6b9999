#include "runtime/roofline.h"

#include <algorithm>

#include "core/error.h"
#include "runtime/memory_plan.h"

namespace chimera {

int64_t active_parameter_count(const ModelConfig& c) {
  const auto moe_layers = static_cast<int64_t>(std::count(c.layers.begin(), c.layers.end(), LayerKind::kMoe));
  // Per MoE layer, E experts of up [I, Lat|D] and down [Lat|D, I]; a token uses top-k of them.
  const int64_t per_expert = 2 * c.moe_intermediate_size * c.moe_input_dim();
  const int64_t unused = moe_layers * (c.n_routed_experts - c.num_experts_per_tok) * per_expert;
  return parameter_count(c) - (moe_layers > 0 ? unused : 0);
}

DecodeRoofline batch1_decode_roofline(const ModelConfig& c, DType weight_dtype, double bandwidth) {
  if (!(bandwidth > 0)) invalid_input("roofline: bandwidth must be > 0 bytes/s, got {}", bandwidth);
  DecodeRoofline r;
  r.active_params = active_parameter_count(c);
  r.bandwidth = bandwidth;
  const auto wsize = static_cast<double>(dtype_size(weight_dtype));
  // fp32-kept parameters are all read per token (the router scores every expert).
  const auto f32 = static_cast<double>(fp32_parameter_count(c));
  // The embedding table is gathered: one row of hidden_size per token, not vocab_size rows.
  r.params_read = r.active_params - (c.vocab_size - 1) * c.hidden_size;
  r.bytes_per_token = (static_cast<double>(r.params_read) - f32) * wsize + f32 * 4.0;
  r.tokens_per_s = bandwidth / r.bytes_per_token;
  return r;
}

}  // namespace chimera
