// Config presets for synthetic (random-weight) models: the published configs of docs/model.md section 9 as
// config.json text, parsed by the same parser as a checkpoint's config.json, plus `tiny` for tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/model_config.h"

namespace chimera {

// "nemotron-h-8b", "nemotron-3-nano-30b-a3b", "nemotron-3-super-120b-a12b", "tiny".
std::vector<std::string> model_preset_names();
// The preset's config; an unknown name -> kInvalidInput listing the presets.
ModelConfig model_preset(const std::string& name);
// Keeps the first `num_layers` layers of the pattern (so a large model fits one device); num_layers must be
// in [1, num_hidden_layers] (kInvalidInput otherwise). The MTP head is kept.
void truncate_layers(ModelConfig& config, int64_t num_layers);

}  // namespace chimera
