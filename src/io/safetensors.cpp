// safetensors: layout is [u64 LE header length][header JSON][data section]. Every offset in the header
// is relative to the start of the data section.
//
// Alignment: the data section starts 8 + header_len bytes into a page-aligned mapping. HF pads the header to
// a multiple of 8, so with HF-written files each tensor is aligned to its dtype as long as the offsets are,
// but the format does not promise it: a tensor from another writer may start at any byte. Tensor views
// returned here therefore may be misaligned for their dtype; Chimera's CPU code reads checkpoint tensors
// through memcpy-safe paths (load_as_f32 / convert_to_f32) and device uploads are byte copies.
// The mapping is PROT_READ: writing through a returned view faults.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_file.h"

namespace chimera {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string supported_dtypes() {
  std::string s;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kU8, DType::kI8, DType::kI32,
                  DType::kI64}) {
    if (!s.empty()) s += ", ";
    s += dtype_name(t);
  }
  return s;
}

// A JSON value as a non-negative integer, or nullopt.
std::optional<uint64_t> as_u64(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

}  // namespace

SafetensorsFile::~SafetensorsFile() = default;

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const fs::path& path) {
  const std::string p = path.string();
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) invalid_input("{}: cannot open: {}", p, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    invalid_input("{}: not a regular file", p);
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    invalid_input("{}: file is {} bytes, too short for a safetensors file (8-byte header length missing)", p, size);
  }
  void* addr = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping stays valid without the descriptor
  if (addr == MAP_FAILED) invalid_input("{}: mmap of {} bytes failed: {}", p, size, std::strerror(map_errno));

  return from_memory(std::shared_ptr<void>(addr, [size](void* a) { ::munmap(a, size); }), size, path);
}

std::shared_ptr<SafetensorsFile> SafetensorsFile::from_memory(std::shared_ptr<void> bytes, size_t size,
                                                              const fs::path& path) {
  const std::string p = path.string();
  if (size < 8) {
    invalid_input("{}: file is {} bytes, too short for a safetensors file (8-byte header length missing)", p, size);
  }
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->file_size_ = size;
  f->mapping_ = std::move(bytes);
  const auto* base = static_cast<const unsigned char*>(f->mapping_.get());

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base[i];
  // The length field is not echoed: for a file that is not a safetensors file it is 8 bytes of its content.
  if (header_len > size - 8) {
    invalid_input("{}: the header length field exceeds the {} bytes after it (not a safetensors file, or truncated)",
                  p, size - 8);
  }
  const char* header = reinterpret_cast<const char*>(base + 8);
  f->data_ = header + header_len;
  const uint64_t data_size = size - 8 - header_len;

  // Duplicate keys (a tensor named twice), numbers outside a double, deep nesting: kInvalidInput naming the file.
  const json h = parse_json(std::string_view(header, header_len), p + " header");
  if (!h.is_object()) invalid_input("{}: header must be a JSON object, got {}", p, h.type_name());

  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) invalid_input("{}: '__metadata__' must be an object of strings, got {}", p, v.type_name());
      for (const auto& [k, mv] : v.items()) {
        if (!mv.is_string()) {
          invalid_input("{}: '__metadata__' entry '{}' must be a string, got {}", p, k, mv.type_name());
        }
        f->metadata_[k] = mv.get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) invalid_input("{}: tensor '{}': entry must be an object, got {}", p, name, v.type_name());

    const auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) invalid_input("{}: tensor '{}': missing string field 'dtype'", p, name);
    const std::string dtype_str = dt->get<std::string>();
    const auto dtype = dtype_from_name(dtype_str);
    if (!dtype) {
      invalid_input("{}: tensor '{}': unsupported dtype '{}' (supported: {})", p, name, dtype_str, supported_dtypes());
    }

    const auto sh = v.find("shape");
    if (sh == v.end() || !sh->is_array()) invalid_input("{}: tensor '{}': missing array field 'shape'", p, name);
    Shape shape;
    uint64_t nbytes = dtype_size(*dtype);
    for (const auto& d : *sh) {
      const auto n = as_u64(d);
      if (!n || *n > static_cast<uint64_t>(INT64_MAX)) {
        invalid_input("{}: tensor '{}': shape {} must hold non-negative integers", p, name, sh->dump());
      }
      if (__builtin_mul_overflow(nbytes, *n, &nbytes)) {
        invalid_input("{}: tensor '{}': shape {} is too large", p, name, sh->dump());
      }
      shape.push_back(static_cast<int64_t>(*n));
    }

    const auto off = v.find("data_offsets");
    if (off == v.end() || !off->is_array() || off->size() != 2 || !as_u64((*off)[0]) || !as_u64((*off)[1])) {
      invalid_input("{}: tensor '{}': 'data_offsets' must be [begin, end] with non-negative integers", p, name);
    }
    const uint64_t begin = *as_u64((*off)[0]), end = *as_u64((*off)[1]);
    if (begin > end) invalid_input("{}: tensor '{}': data_offsets [{}, {}] has begin > end", p, name, begin, end);
    if (end > data_size) {
      invalid_input("{}: tensor '{}': data_offsets [{}, {}] end beyond the data section of {} bytes (file truncated?)",
                    p, name, begin, end, data_size);
    }
    if (end - begin != nbytes) {
      invalid_input("{}: tensor '{}': data_offsets [{}, {}] hold {} bytes but {}{} needs {}", p, name, begin, end,
                    end - begin, dtype_name(*dtype), shape_str(shape), nbytes);
    }
    Entry e;
    e.info = TensorInfo{name, *dtype, std::move(shape), path};
    e.begin = static_cast<size_t>(begin);
    e.end = static_cast<size_t>(end);
    f->entries_.emplace(name, std::move(e));
  }

  // Overlap check: sort by begin; each tensor must start at or after the previous one's end. Holes are allowed.
  std::vector<const Entry*> by_offset;
  for (const auto& kv : f->entries_) by_offset.push_back(&kv.second);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const Entry& a = *by_offset[i - 1];
    const Entry& b = *by_offset[i];
    if (b.begin < a.end) {
      invalid_input("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' at [{}, {}]", p, b.info.name, b.begin,
                    b.end, a.info.name, a.begin, a.end);
    }
  }
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> r;
  r.reserve(entries_.size());
  for (const auto& [name, e] : entries_) r.push_back(name);
  return r;
}

bool SafetensorsFile::contains(const std::string& name) const { return entries_.count(name) != 0; }

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) invalid_input("{}: no tensor named '{}'", path_.string(), name);
  return it->second.info;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) invalid_input("{}: no tensor named '{}'", path_.string(), name);
  const Entry& e = it->second;
  // const_cast: Tensor has one pointer type; the pages are read-only (see the file comment).
  return Tensor::wrap(const_cast<char*>(data_ + e.begin), e.info.dtype, e.info.shape, mapping_);
}

// ---- Checkpoint ------------------------------------------------------------------------------------

namespace {

// Where a checkpoint's files may live once links are followed: the model directory itself and, for a Hugging
// Face cache snapshot (CACHE/models--X/snapshots/REV, whose files are links to CACHE/models--X/blobs/SHA), that
// cache's blobs directory.
std::vector<fs::path> allowed_roots(const fs::path& model_dir) {
  std::error_code ec;
  const fs::path dir = fs::canonical(model_dir, ec);
  if (ec) invalid_input("model directory '{}': cannot resolve: {}", model_dir.string(), ec.message());
  std::vector<fs::path> roots{dir};
  if (dir.has_parent_path() && dir.parent_path().filename() == "snapshots") {
    roots.push_back(dir.parent_path().parent_path() / "blobs");
  }
  return roots;
}

bool is_under(const fs::path& p, const fs::path& root) {
  auto pi = p.begin();
  for (auto ri = root.begin(); ri != root.end(); ++ri, ++pi) {
    if (ri->empty()) continue;  // a trailing separator
    if (pi == p.end() || *pi != *ri) return false;
  }
  return true;
}

// A file of the checkpoint named `entry` (relative to model_dir), confined: no absolute path, no '..', and after
// following links a regular file under one of `roots`. `where` says who named it, for the messages.
void check_entry_spelling(const std::string& entry, const std::string& where) {
  const fs::path rel(entry);
  if (entry.empty()) invalid_input("{}: the file name is empty", where);
  if (entry.find('\0') != std::string::npos) invalid_input("{}: the file name holds a NUL byte", where);
  if (rel.has_root_path()) {
    invalid_input("{}: '{}' is an absolute path; shards must be files inside the model directory", where, entry);
  }
  for (const auto& part : rel) {
    if (part == "..") {
      invalid_input("{}: '{}' leaves the model directory ('..'); shards must be files inside it", where, entry);
    }
  }
}

std::string entry_where(const std::string& index, const std::string& tensor, const std::string& shard) {
  return fmt::format("{}: weight_map entry for tensor '{}' (shard '{}')", index, tensor, shard);
}

fs::path confined_file(const fs::path& model_dir, const std::string& entry, const std::vector<fs::path>& roots,
                       const std::string& where) {
  check_entry_spelling(entry, where);
  const fs::path rel(entry);
  const fs::path joined = model_dir / rel;
  std::error_code ec;
  if (!fs::exists(joined, ec)) invalid_input("{}: '{}' does not exist", where, joined.string());
  const fs::path real = fs::canonical(joined, ec);
  if (ec) invalid_input("{}: '{}' cannot be resolved: {}", where, joined.string(), ec.message());
  bool inside = false;
  for (const auto& r : roots) inside = inside || is_under(real, r);
  if (!inside) {
    invalid_input("{}: '{}' resolves to '{}', outside the model directory '{}' (a link leaving it)", where, entry,
                  real.string(), roots.front().string());
  }
  if (!fs::is_regular_file(real, ec)) invalid_input("{}: '{}' is not a regular file", where, joined.string());
  return joined;
}

}  // namespace

std::map<std::string, std::string> parse_safetensors_index(const std::string& json_text, const std::string& source) {
  const json idx = parse_json(json_text, source);
  if (!idx.is_object()) invalid_input("{}: must be a JSON object", source);
  const auto wm = idx.find("weight_map");
  if (wm == idx.end() || !wm->is_object()) invalid_input("{}: missing object field 'weight_map'", source);
  std::map<std::string, std::string> weight_map;
  for (const auto& item : wm->items()) {
    if (!item.value().is_string()) {
      invalid_input("{}: weight_map entry '{}' must be a file name string", source, item.key());
    }
    const std::string shard = item.value().get<std::string>();
    check_entry_spelling(shard, entry_where(source, item.key(), shard));
    weight_map[item.key()] = shard;
  }
  return weight_map;
}

Checkpoint Checkpoint::open(const fs::path& model_dir) {
  std::error_code ec;
  if (!fs::exists(model_dir, ec)) invalid_input("model directory '{}' does not exist", model_dir.string());
  if (!fs::is_directory(model_dir, ec)) {
    invalid_input("model directory '{}' is a file, expected a directory (config.json, *.safetensors, "
                  "tokenizer.json)",
                  model_dir.string());
  }
  const std::vector<fs::path> roots = allowed_roots(model_dir);

  Checkpoint ck;
  ck.dir_ = model_dir;
  const fs::path index_path = model_dir / "model.safetensors.index.json";
  const fs::path single_path = model_dir / "model.safetensors";

  if (fs::exists(index_path, ec)) {
    const std::string ip = index_path.string();
    const std::map<std::string, std::string> weight_map =
        parse_safetensors_index(read_text_file(index_path, "checkpoint index", kMaxConfigFileBytes), ip);
    std::map<std::string, std::string> first_user;  // shard entry -> a tensor that names it (for messages)
    for (const auto& [name, shard] : weight_map) first_user.emplace(shard, name);
    std::map<std::string, size_t> shard_file;  // shard entry -> index into files_
    for (const auto& [shard, user] : first_user) {  // each shard opened once, in sorted order
      const fs::path sp = confined_file(model_dir, shard, roots, entry_where(ip, user, shard));
      shard_file[shard] = ck.files_.size();
      ck.files_.push_back(SafetensorsFile::open(sp));
    }
    for (const auto& [name, shard] : weight_map) {
      const SafetensorsFile& f = *ck.files_[shard_file.at(shard)];
      if (!f.contains(name)) {
        invalid_input("{}: tensor '{}' is mapped to shard '{}' but that shard has no such tensor", ip, name,
                      f.path().string());
      }
    }
  } else if (fs::exists(single_path, ec) || fs::is_symlink(single_path, ec)) {
    ck.files_.push_back(SafetensorsFile::open(
        confined_file(model_dir, "model.safetensors", roots, model_dir.string() + ": model.safetensors")));
  } else {
    std::vector<fs::path> found;
    for (const auto& de : fs::directory_iterator(model_dir, ec)) {
      if (de.is_regular_file() && de.path().extension() == ".safetensors") found.push_back(de.path());
    }
    if (ec) invalid_input("model directory '{}': cannot list: {}", model_dir.string(), ec.message());
    if (found.empty()) {
      invalid_input("model directory '{}' holds no checkpoint: looked for model.safetensors.index.json, "
                    "model.safetensors and *.safetensors",
                    model_dir.string());
    }
    std::sort(found.begin(), found.end());
    for (const auto& fp : found) {
      const std::string entry = fp.filename().string();
      ck.files_.push_back(SafetensorsFile::open(confined_file(model_dir, entry, roots, fp.string())));
    }
  }

  for (size_t i = 0; i < ck.files_.size(); ++i) {
    for (const auto& name : ck.files_[i]->names()) {
      const auto [it, inserted] = ck.where_.emplace(name, i);
      if (!inserted) {
        invalid_input("model directory '{}': tensor '{}' appears in both {} and {}", model_dir.string(), name,
                      ck.files_[it->second]->path().string(), ck.files_[i]->path().string());
      }
    }
  }
  return ck;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> r;
  r.reserve(where_.size());
  for (const auto& [name, i] : where_) r.push_back(name);
  return r;
}

bool Checkpoint::contains(const std::string& name) const { return where_.count(name) != 0; }

const TensorInfo& Checkpoint::info(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) invalid_input("model directory '{}': no tensor named '{}'", dir_.string(), name);
  return files_[it->second]->info(name);
}

Tensor Checkpoint::tensor(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) invalid_input("model directory '{}': no tensor named '{}'", dir_.string(), name);
  return files_[it->second]->tensor(name);
}

// ---- writer ----------------------------------------------------------------------------------------

void write_safetensors(const fs::path& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();  // std::map-backed: keys come out sorted
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    CHIMERA_CHECK(t.device() == Device::kCpu, "write_safetensors: tensor '{}' is not on the host", name);
    CHIMERA_CHECK(!header.contains(name), "write_safetensors: duplicate tensor name '{}'", name);
    header[name] = {{"dtype", std::string(dtype_name(t.dtype()))},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  // HF pads the header with spaces so the data section starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) invalid_input("{}: cannot open for writing", path.string());
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& [name, t] : tensors) {
    out.write(static_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  }
  out.close();
  if (!out) runtime_error("{}: write failed", path.string());
}

}  // namespace chimera
