#include "runtime/kernel_env.h"

#include <cstdlib>
#include <cstring>
#include <string_view>

#include "core/error.h"
#include "dist/strategy.h"

namespace chimera {
namespace {

constexpr KernelEnvVar kVars[] = {
    {"CHIMERA_PDL", "0 or 1", "KernelConfig::pdl"},
    {"CHIMERA_MAMBA_DECODE_FUSED_MAX_ROWS", "an integer >= 0", "KernelConfig::mamba_decode_fused_max_rows"},
    {"CHIMERA_MAMBA_PREFETCH", "0 or 1", "KernelConfig::mamba_prefetch_states"},
    {"CHIMERA_SSU_DYNAMIC", "0 or 1", "KernelConfig::ssu_dynamic_split"},
    {"CHIMERA_ATTN_DECODE_APPEND", "0 or 1", "KernelConfig::attention_decode_append"},
    {"CHIMERA_RESIDUAL_NORM_FOLD", "0 or 1", "KernelConfig::residual_norm_fold"},
    {"CHIMERA_ROUTER_CLUSTER", "0 or 1", "KernelConfig::router_cluster"},
    {"CHIMERA_MOE_GEMV_FOLD", "0 or 1", "KernelConfig::moe_gemv_fold"},
    {"CHIMERA_MOE_EARLY_SHARED", "0 or 1", "KernelConfig::moe_early_shared"},
    {"CHIMERA_MOE_DOWN_EARLY", "0 or 1", "KernelConfig::moe_down_early"},
    {"CHIMERA_MOE_CUTLASS", "0 or 1", "KernelConfig::moe_cutlass"},
    {"CHIMERA_MOE_CUTLASS_TILE_N", "0, 64 or 128", "KernelConfig::moe_cutlass_tile_n"},
};

[[noreturn]] void bad(const KernelEnvVar& v, const char* value) {
  invalid_input("environment variable {}='{}': expected {} ({})", v.name, value, v.values, v.meaning);
}

}  // namespace

std::span<const KernelEnvVar> kernel_env_vars() { return kVars; }

ops::KernelConfig kernel_config_from(const std::function<const char*(const char*)>& lookup, ops::KernelConfig base) {
  ops::KernelConfig k = base;
  for (const KernelEnvVar& v : kVars) {
    const char* value = lookup(v.name);
    if (value == nullptr) continue;
    const std::string_view s(value);
    const std::string_view name(v.name);
    if (name == "CHIMERA_MAMBA_DECODE_FUSED_MAX_ROWS") {
      if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string_view::npos) bad(v, value);
      k.mamba_decode_fused_max_rows = std::atoll(value);
      continue;
    }
    if (name == "CHIMERA_MOE_CUTLASS_TILE_N") {
      if (s != "0" && s != "64" && s != "128") bad(v, value);
      k.moe_cutlass_tile_n = std::atoi(value);
      continue;
    }
    if (s != "0" && s != "1") bad(v, value);
    const bool on = s == "1";
    if (name == "CHIMERA_PDL") k.pdl = on;
    if (name == "CHIMERA_MAMBA_PREFETCH") k.mamba_prefetch_states = on;
    if (name == "CHIMERA_SSU_DYNAMIC") k.ssu_dynamic_split = on;
    if (name == "CHIMERA_ATTN_DECODE_APPEND") k.attention_decode_append = on;
    if (name == "CHIMERA_RESIDUAL_NORM_FOLD") k.residual_norm_fold = on;
    if (name == "CHIMERA_ROUTER_CLUSTER") k.router_cluster = on;
    if (name == "CHIMERA_MOE_GEMV_FOLD") k.moe_gemv_fold = on;
    if (name == "CHIMERA_MOE_EARLY_SHARED") k.moe_early_shared = on;
    if (name == "CHIMERA_MOE_DOWN_EARLY") k.moe_down_early = on;
    if (name == "CHIMERA_MOE_CUTLASS") k.moe_cutlass = on;
  }
  return k;
}

ops::KernelConfig kernel_config_from_env(ops::KernelConfig base) {
  return kernel_config_from([](const char* name) { return std::getenv(name); }, base);
}

dist::AllReduceStrategy allreduce_strategy_from(const std::function<const char*(const char*)>& lookup) {
  const char* value = lookup(kAllReduceStrategyVar);
  if (value == nullptr) return dist::AllReduceStrategy::kAuto;
  if (const auto s = dist::strategy_from_name(value)) return *s;
  invalid_input("environment variable {}='{}': expected auto, nccl, oneshot or twoshot (the forced AllReduce strategy)",
                kAllReduceStrategyVar, value);
}

dist::AllReduceStrategy allreduce_strategy_from_env() {
  return allreduce_strategy_from([](const char* name) { return std::getenv(name); });
}

}  // namespace chimera
