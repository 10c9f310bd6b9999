// Strategy names, parsing (for the CLI flag / CHIMERA_ALLREDUCE_STRATEGY, read once by the CLI layer) and the
// AUTO decision: which strategy a call of a given shape takes. Pure host code, built in every configuration
// and unit-tested on the CPU.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "dist/allreduce_types.h"

namespace chimera::dist {

std::string_view strategy_name(AllReduceStrategy s);  // "auto", "nccl", "oneshot", "twoshot"
std::string_view pattern_name(FusionPattern p);       // "allreduce", "residual_rmsnorm", ...
// Case-insensitive; nullopt for anything else.
std::optional<AllReduceStrategy> strategy_from_name(std::string_view name);
// As strategy_from_name but throws kInvalidInput listing the accepted names (what a CLI flag wants).
AllReduceStrategy parse_strategy(std::string_view name);

// Everything the choice depends on. elem_bytes: 2 (bf16/fp16) or 4 (fp32).
struct StrategyQuery {
  int n_ranks = 2;
  FusionPattern pattern = FusionPattern::kResidualRmsNorm;
  int64_t hidden = 0;
  int64_t tokens = 0;
  int elem_bytes = 2;
  bool peer_access = false;         // every pair of ranks can map each other's memory (Topology)
  int64_t max_message_bytes = 0;    // the workspace capacity per message (AllReduceConfig)
};

// Can the custom kernels run this call at all? (peer access, 2..8 ranks, rows of whole 16-byte vectors, at most
// kMaxRowVecs vectors a row, message within the workspace). When false the call goes to NCCL whatever was asked.
inline constexpr int64_t kMaxRowVecs = 4096;  // 1024 threads x 4 vectors in registers: bf16 32768, fp32 16384
bool custom_eligible(const StrategyQuery& q);

// The SM90 lookup table keyed (ranks index, pattern, measured hidden, measured tokens) (as TensorRT-LLM's
// static table, its power-of-two buckets replaced by the sizes the sweep measured: allreduce_index.h,
// table_hidden_index / table_tokens_index), generated into src/dist/sm90_allreduce_table.inc by scripts/make_allreduce_table.py from
// the sweep (`chimera_bench allreduce_sweep`, which iterates sm90_table_hidden() x sm90_table_tokens(), so the
// sweep and the lookup use the same sizes). Sizes outside the table clamp to its edge; ranks other than 2, 4, 8
// get NCCL. Entries not measured follow the default rule: ONESHOT up to kOneShotMaxTokens tokens (TensorRT-LLM's
// kOneShotMaxToken = 128), TWOSHOT above.
inline constexpr int64_t kOneShotMaxTokens = 128;
AllReduceStrategy lookup_sm90(int n_ranks, FusionPattern pattern, int64_t hidden, int64_t tokens);
// The measured sizes the table is keyed by, ascending (those of the sweep that wrote it).
std::span<const int64_t> sm90_table_hidden();
std::span<const int64_t> sm90_table_tokens();
// The sizes `chimera_bench allreduce_sweep` measures (it prints them in a SWEEP-GRID line, from which the
// script takes the table's lists): every power of two plus the models' hidden sizes (Nemotron-H 2688, 4096,
// 4480, 8192), and token counts at half-octave steps from 128, where the strategies cross over.
inline constexpr int64_t kSweepHidden[] = {128, 256, 512, 1024, 2048, 2688, 4096, 4480, 8192, 16384};
inline constexpr int64_t kSweepTokens[] = {1,   2,   4,    8,    16,   32,   64,   128,  192,  256,
                                           384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192};
// Whether the table's rows for n_ranks come from a measurement (false: the default rule; 4 and 8 ranks always,
// until a 4/8-GPU machine runs the sweep).
bool sm90_table_measured(int n_ranks);

// The strategy a call takes: `forced` unless it is kAuto (a forced custom strategy that is not eligible falls
// back to NCCL), else the lookup table; never kAuto.
AllReduceStrategy select_strategy(const StrategyQuery& q, AllReduceStrategy forced);

}  // namespace chimera::dist
