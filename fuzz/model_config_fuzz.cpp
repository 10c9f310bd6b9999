// config.json text: a config that parses has sizes whose parameter counts and memory plan are computed
// without overflow (or refused as overflowing), for the serving limits at their extremes.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "fuzz_util.h"
#include "io/model_config.h"
#include "runtime/memory_plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace chimera;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean([&] {
    const ModelConfig c = parse_model_config(text, "config.json");
    fuzz::require(!c.layers.empty(), "a config has layers");
    for (int64_t id : c.eos_token_ids) fuzz::require(id >= 0 && id < c.vocab_size, "eos id in the vocabulary");
    MemoryLimits small;
    small.max_num_seqs = 1;
    small.max_model_len = 16;
    MemoryLimits huge;
    huge.max_num_seqs = std::numeric_limits<int32_t>::max();
    huge.max_model_len = std::numeric_limits<int32_t>::max();
    huge.max_tokens_per_step = std::numeric_limits<int32_t>::max();
    for (const MemoryLimits& lim : {small, huge}) {
      fuzz::expect_clean([&] {
        const MemoryPlan p = plan_memory(c, DType::kBF16, DType::kF32, lim);
        fuzz::require(p.total() >= p.kv_cache && p.total() >= p.weights, "total covers its parts");
      });
    }
  });
  return 0;
}
