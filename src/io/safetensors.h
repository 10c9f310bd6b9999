// safetensors reader: memory-mapped, every header checked (docs/model.md 2.1):
//   header length within the file, JSON well formed, dtype known, data_offsets inside the data section,
//   end - begin == numel * dtype size, no two tensors overlapping. Errors (kInvalidInput) name the file
//   and the tensor.
// Sharded checkpoints are read through model.safetensors.index.json ("weight_map": name -> shard file).
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace chimera {

struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  std::filesystem::path file;  // the shard holding it
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates the header.
  static std::shared_ptr<SafetensorsFile> open(const std::filesystem::path& path);
  // The same checks on a file image in memory (`bytes` owns `size` bytes); `path` names it in errors.
  static std::shared_ptr<SafetensorsFile> from_memory(std::shared_ptr<void> bytes, size_t size,
                                                      const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // kInvalidInput if missing
  // A zero-copy host tensor viewing the mapping; keeps the mapping alive.
  Tensor tensor(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  struct Entry {
    TensorInfo info;
    size_t begin = 0, end = 0;  // byte offsets relative to the data section
  };
  std::filesystem::path path_;
  std::shared_ptr<void> mapping_;  // munmap on release
  const char* data_ = nullptr;     // start of the data section
  size_t file_size_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: a single model.safetensors, an index with shards, or (as a
// fallback) every *.safetensors file in the directory. Duplicate names across shards -> kInvalidInput.
class Checkpoint {
 public:
  static Checkpoint open(const std::filesystem::path& model_dir);
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;
  Tensor tensor(const std::string& name) const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // name -> index into files_
};

// model.safetensors.index.json text -> its weight_map (tensor -> shard entry). Every entry is checked to name a
// file inside the model directory by its spelling (relative, no '..'); Checkpoint::open also resolves links.
std::map<std::string, std::string> parse_safetensors_index(const std::string& json_text, const std::string& source);

// Writes tensors to a .safetensors file (used by tests to build corrupt / small checkpoints).
void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace chimera
