// Loading a model directory for the CLI: config, checkpoint, weights and (optionally) the tokenizer.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "tokenizer/tokenizer.h"

namespace chimera::cli {

struct LoadedModel {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<NemotronH> model;
  std::optional<Tokenizer> tokenizer;  // absent when the directory has no tokenizer.json
};

// `options` say where the weights go (ModelOptions: CPU zero-copy, or uploaded to the GPU in a dtype).
LoadedModel load_model_dir(const std::string& dir, bool with_weights = true, const ModelOptions& options = {});

}  // namespace chimera::cli
