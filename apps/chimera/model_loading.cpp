#include "model_loading.h"

#include <filesystem>

#include "core/error.h"

namespace chimera::cli {

std::string default_model_dir() { return CHIMERA_DEFAULT_MODEL_DIR; }

LoadedModel load_model_dir(const std::string& dir, bool with_weights, const ModelOptions& options) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) invalid_input("model directory '{}' does not exist", dir);
  LoadedModel m;
  m.config = load_model_config(dir);
  m.checkpoint = std::make_unique<Checkpoint>(Checkpoint::open(dir));
  if (with_weights) m.model = std::make_unique<NemotronH>(NemotronH::load(m.config, *m.checkpoint, options));
  const fs::path tok = fs::path(dir) / "tokenizer.json";
  if (fs::exists(tok)) m.tokenizer.emplace(Tokenizer::load(tok));
  return m;
}

}  // namespace chimera::cli
