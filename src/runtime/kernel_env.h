// The one registry of environment overrides of ops::KernelConfig (ops/kernel_config.h), for A/B runs of whole
// benchmarks without rebuilding: the CLI (chimera generate / bench) and chimera_bench read it once at start, and the
// value then travels in ops::Context like any other configuration. Nothing below src/runtime reads the environment.
//
// Every variable takes exactly the values listed in kernel_env_vars(); anything else (including an empty string) is
// ErrorKind::kInvalidInput naming the variable, its value and the accepted values. Unset variables keep `base`.
#pragma once

#include <functional>
#include <span>

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

}  // namespace chimera
