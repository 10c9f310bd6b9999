// The one registry of environment overrides of ops::KernelConfig (ops/kernel_config.h), for A/B runs of whole
// benchmarks without rebuilding: the CLI (chimera generate / bench) reads it once at start, and the value then
// travels in ops::Context like any other configuration (chimera_bench's cases set the fields they compare
// themselves; it reads only CHIMERA_ALLREDUCE_STRATEGY, below). Nothing below src/runtime reads the environment.
//
// Every variable takes exactly the values listed in kernel_env_vars(); anything else (including an empty string) is
// ErrorKind::kInvalidInput naming the variable, its value and the accepted values. Unset variables keep `base`.
#pragma once

#include <functional>
#include <span>

#include "dist/allreduce_types.h"
#include "ops/kernel_config.h"

namespace chimera {

struct KernelEnvVar {
  const char* name;     // e.g. "CHIMERA_PDL"
  const char* values;   // the accepted values, e.g. "0 or 1"
  const char* meaning;  // the KernelConfig field it sets
};
std::span<const KernelEnvVar> kernel_env_vars();

// `base` with every set variable applied, read through `lookup` (nullptr: unset).
ops::KernelConfig kernel_config_from(const std::function<const char*(const char*)>& lookup,
                                     ops::KernelConfig base = {});
// The same through the process environment.
ops::KernelConfig kernel_config_from_env(ops::KernelConfig base = {});

// CHIMERA_ALLREDUCE_STRATEGY (auto, nccl, oneshot or twoshot, any case): the forced AllReduce strategy of
// chimera_bench's AllReduce benchmarks. The CLI takes the same variable as the environment name of
// --allreduce-strategy, checked by the same parser (dist::strategy_from_name). Unset: kAuto; anything else is
// kInvalidInput naming the variable.
inline constexpr const char* kAllReduceStrategyVar = "CHIMERA_ALLREDUCE_STRATEGY";
dist::AllReduceStrategy allreduce_strategy_from(const std::function<const char*(const char*)>& lookup);
dist::AllReduceStrategy allreduce_strategy_from_env();

}  // namespace chimera
