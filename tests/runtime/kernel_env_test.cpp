// The environment registry of kernel-choice overrides (runtime/kernel_env.h): unset variables keep the base
// configuration, each documented value sets its field, and anything else is a clear kInvalidInput error naming the
// variable, the value and what it accepts.
#include "runtime/kernel_env.h"

#include <cstring>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/backend_param.h"
#include "core/error.h"

namespace chimera {
namespace {

using Env = std::vector<std::pair<const char*, const char*>>;  // (name, value) of the set variables

ops::KernelConfig from(const Env& env, ops::KernelConfig base = {}) {
  return kernel_config_from(
      [&](const char* name) -> const char* {
        for (const auto& [n, v] : env) {
          if (std::strcmp(n, name) == 0) return v;
        }
        return nullptr;
      },
      base);
}

TEST(KernelEnv, UnsetKeepsTheBase) {
  const ops::KernelConfig d = from({});
  const ops::KernelConfig def;
  EXPECT_EQ(d.pdl, def.pdl);
  EXPECT_EQ(d.mamba_decode_fused_max_rows, def.mamba_decode_fused_max_rows);
  ops::KernelConfig base;
  base.router_cluster = false;
  EXPECT_FALSE(from({}, base).router_cluster);
}

TEST(KernelEnv, EveryVariableSetsItsField) {
  Env off;
  for (const KernelEnvVar& v : kernel_env_vars()) off.emplace_back(v.name, "0");
  const ops::KernelConfig k = from(off);
  EXPECT_FALSE(k.pdl);
  EXPECT_EQ(k.mamba_decode_fused_max_rows, 0);
  EXPECT_FALSE(k.mamba_prefetch_states);
  EXPECT_FALSE(k.ssu_dynamic_split);
  EXPECT_FALSE(k.attention_decode_append);
  EXPECT_FALSE(k.residual_norm_fold);
  EXPECT_FALSE(k.router_cluster);
  EXPECT_FALSE(k.moe_gemv_fold);
  EXPECT_FALSE(k.moe_early_shared);
  EXPECT_FALSE(k.moe_down_early);
  EXPECT_FALSE(k.moe_cutlass);
  EXPECT_EQ(k.moe_cutlass_tile_n, 0);
  EXPECT_EQ(from({{"CHIMERA_MOE_CUTLASS_TILE_N", "128"}}).moe_cutlass_tile_n, 128);
  EXPECT_EQ(from({{"CHIMERA_MAMBA_DECODE_FUSED_MAX_ROWS", "8"}}).mamba_decode_fused_max_rows, 8);
  ops::KernelConfig base;
  base.pdl = false;
  EXPECT_TRUE(from({{"CHIMERA_PDL", "1"}}, base).pdl);
}

TEST(KernelEnv, BadValuesAreRefusedByName) {
  EXPECT_TRUE(test::throws_error([] { from({{"CHIMERA_PDL", "2"}}); }, ErrorKind::kInvalidInput,
                                 "environment variable CHIMERA_PDL='2': expected 0 or 1"));
  EXPECT_TRUE(test::throws_error([] { from({{"CHIMERA_MOE_GEMV_FOLD", ""}}); }, ErrorKind::kInvalidInput,
                                 "CHIMERA_MOE_GEMV_FOLD=''"));
  EXPECT_TRUE(test::throws_error([] { from({{"CHIMERA_MOE_CUTLASS_TILE_N", "96"}}); }, ErrorKind::kInvalidInput,
                                 "expected 0, 64 or 128"));
  EXPECT_TRUE(test::throws_error([] { from({{"CHIMERA_MAMBA_DECODE_FUSED_MAX_ROWS", "-1"}}); },
                                 ErrorKind::kInvalidInput, "CHIMERA_MAMBA_DECODE_FUSED_MAX_ROWS"));
}

TEST(KernelEnv, AllReduceStrategyIsParsedOnce) {
  auto strategy = [](const char* value) {
    return allreduce_strategy_from([&](const char* name) -> const char* {
      return std::strcmp(name, "CHIMERA_ALLREDUCE_STRATEGY") == 0 ? value : nullptr;
    });
  };
  EXPECT_EQ(strategy(nullptr), dist::AllReduceStrategy::kAuto);
  EXPECT_EQ(strategy("oneshot"), dist::AllReduceStrategy::kOneShot);
  EXPECT_EQ(strategy("TwoShot"), dist::AllReduceStrategy::kTwoShot);
  EXPECT_EQ(strategy("nccl"), dist::AllReduceStrategy::kNccl);
  EXPECT_TRUE(test::throws_error([&] { strategy("legacy"); }, ErrorKind::kInvalidInput,
                                 "environment variable CHIMERA_ALLREDUCE_STRATEGY='legacy': expected auto, nccl"));
  EXPECT_TRUE(test::throws_error([&] { strategy(""); }, ErrorKind::kInvalidInput, "CHIMERA_ALLREDUCE_STRATEGY=''"));
}

}  // namespace
}  // namespace chimera
