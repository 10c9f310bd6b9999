#include "runtime/state_cache.h"

#include <algorithm>
#include <atomic>

#include "backends/device_api.h"
#include "core/error.h"

namespace chimera {
namespace {

Tensor zeros(Device device, DType dtype, Shape shape) {
  Tensor t = device::empty(device, dtype, std::move(shape));
  device::zero(t);
  return t;
}

}  // namespace

StateCache::StateCache(const ModelConfig& config, const CacheSizes& sizes, Device device, DType act_dtype)
    : sizes_(sizes), device_(device), blocks_(0, 1, false), checkpoints_({}) {
  if (sizes_.max_seqs < 1) invalid_input("max sequences must be >= 1, got {}", sizes_.max_seqs);
  if (sizes_.max_model_len < 1) invalid_input("max model length must be >= 1, got {}", sizes_.max_model_len);
  if (sizes_.block_size < 1) invalid_input("KV block size must be >= 1, got {}", sizes_.block_size);
  if (sizes_.num_pad < 0) runtime_error("StateCache: {} pad slots", sizes_.num_pad);
  if (sizes_.ssm_dtype != DType::kF32 && sizes_.ssm_dtype != DType::kBF16 && sizes_.ssm_dtype != DType::kF16) {
    invalid_input("the Mamba SSM state dtype must be float32, bfloat16 or float16, got {}",
                  dtype_name(sizes_.ssm_dtype));
  }
  if (sizes_.num_blocks <= 0) sizes_.num_blocks = sizes_.max_seqs * blocks_per_seq();
  // A sequence alone must always fit, or preemption could not make room for it.
  if (sizes_.num_blocks < blocks_per_seq()) {
    invalid_input("a KV pool of {} blocks of {} tokens cannot hold one sequence of --max-model-len {}",
                  sizes_.num_blocks, sizes_.block_size, sizes_.max_model_len);
  }

  if (sizes_.spare_slots < 0) runtime_error("StateCache: {} spare slots per sequence", sizes_.spare_slots);
  if (sizes_.prefix_caching) {
    if (sizes_.checkpoint_slots < 0) {
      invalid_input("--mamba-checkpoint-slots must be >= 0, got {}", sizes_.checkpoint_slots);
    }
    if (sizes_.checkpoint_interval < sizes_.block_size || sizes_.checkpoint_interval % sizes_.block_size != 0) {
      invalid_input("--mamba-checkpoint-interval {} must be a positive multiple of the KV block size {}",
                    sizes_.checkpoint_interval, sizes_.block_size);
    }
  } else {
    sizes_.checkpoint_slots = 0;
  }
  const int64_t spare_total = int64_t{sizes_.max_seqs} * sizes_.spare_slots;
  const int64_t slots = int64_t{sizes_.max_seqs} + sizes_.num_pad + spare_total + sizes_.checkpoint_slots;
  const int64_t blocks = int64_t{sizes_.num_blocks} + sizes_.num_pad;
  // The backbone's layers, then (CacheSizes::mtp) the MTP head's sublayers, block after block.
  std::vector<LayerKind> kinds = config.layers;
  if (sizes_.mtp) {
    const std::vector<LayerKind> head = mtp_cache_layers(config);
    kinds.insert(kinds.end(), head.begin(), head.end());
  }
  const size_t n = kinds.size();
  state_.conv.resize(n);
  state_.ssm.resize(n);
  state_.kv.resize(n);
  for (size_t i = 0; i < n; ++i) {
    switch (kinds[i]) {
      case LayerKind::kMamba:
        state_.conv[i] = zeros(device, act_dtype, {slots, config.conv_dim(), config.conv_kernel - 1});
        state_.ssm[i] = zeros(device, sizes_.ssm_dtype,
                              {slots, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size});
        break;
      case LayerKind::kAttention: {
        const Shape kv_shape{blocks, sizes_.block_size, config.num_key_value_heads, config.head_dim};
        const DType kv_dtype = sizes_.kv_cache_fp8 ? DType::kF8E4M3 : act_dtype;
        state_.kv[i] = ops::KvCacheView{zeros(device, kv_dtype, kv_shape), zeros(device, kv_dtype, kv_shape)};
        break;
      }
      case LayerKind::kMlp:
      case LayerKind::kMoe: break;
    }
  }
  if (sizes_.tensor_parallel_size < 1)
    runtime_error("StateCache: tensor parallel size {}", sizes_.tensor_parallel_size);
  if (!sizes_.rank_devices.empty() && static_cast<int32_t>(sizes_.rank_devices.size()) != sizes_.tensor_parallel_size) {
    runtime_error("StateCache: {} rank devices for {} ranks", sizes_.rank_devices.size(), sizes_.tensor_parallel_size);
  }
  for (int32_t r = 1; r < sizes_.tensor_parallel_size; ++r) {
    const device::DeviceGuard on(rank_device(r));
    ModelState peer;
    peer.conv.resize(n);
    peer.ssm.resize(n);
    peer.kv.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (state_.conv[i]) {
        peer.conv[i] = zeros(device, state_.conv[i].dtype(), state_.conv[i].shape());
        peer.ssm[i] = zeros(device, state_.ssm[i].dtype(), state_.ssm[i].shape());
      }
      if (state_.kv[i].k) {
        const Tensor& k = state_.kv[i].k;
        peer.kv[i] = ops::KvCacheView{zeros(device, k.dtype(), k.shape()), zeros(device, k.dtype(), k.shape())};
      }
    }
    state_.peers.push_back(std::move(peer));
  }
  static std::atomic<uint64_t> next_layout_id{1};
  state_.layout_id = next_layout_id++;
  const int32_t spare_begin = sizes_.max_seqs + sizes_.num_pad;
  for (int32_t s = spare_begin + static_cast<int32_t>(spare_total) - 1; s >= spare_begin; --s) free_slots_.push_back(s);
  for (int32_t s = sizes_.max_seqs - 1; s >= 0; --s) free_slots_.push_back(s);
  blocks_ = BlockPool(sizes_.num_blocks, sizes_.block_size, sizes_.prefix_caching);
  std::vector<int32_t> checkpoint_ids;
  for (int32_t j = 0; j < sizes_.checkpoint_slots; ++j) {
    checkpoint_ids.push_back(spare_begin + static_cast<int32_t>(spare_total) + j);
  }
  checkpoints_ = CheckpointPool(std::move(checkpoint_ids));
}

int32_t StateCache::allocate_slot(bool zeroed) {
  if (free_slots_.empty()) return -1;
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  if (!zeroed) return slot;
  const StateOp op{StateOp::kZeroSlot, slot, 0};
  for_each_rank([&](int, const ModelState& st) { apply_state_op(op, st); });
  if (sizes_.log_state_ops) state_.remote_ops.push_back(op);
  return slot;
}

std::vector<int32_t> StateCache::allocate_spare_slots() {
  const auto n = static_cast<size_t>(sizes_.spare_slots);
  if (free_slots_.size() < n) return {};
  std::vector<int32_t> out(free_slots_.end() - static_cast<long>(n), free_slots_.end());
  free_slots_.resize(free_slots_.size() - n);
  return out;
}

int32_t StateCache::pad_slot(int32_t j) const {
  CHIMERA_CHECK(j >= 0 && j < sizes_.num_pad, "pad slot {} of {}", j, sizes_.num_pad);
  return sizes_.max_seqs + j;
}

int32_t StateCache::pad_block(int32_t j) const {
  CHIMERA_CHECK(j >= 0 && j < sizes_.num_pad, "pad block {} of {}", j, sizes_.num_pad);
  return sizes_.num_blocks + j;
}

void StateCache::release_slot(int32_t slot) {
  const int32_t spare_begin = sizes_.max_seqs + sizes_.num_pad;
  CHIMERA_CHECK((slot >= 0 && slot < sizes_.max_seqs) ||
                    (slot >= spare_begin && slot < spare_begin + sizes_.max_seqs * sizes_.spare_slots),
                "release of slot {}", slot);
  CHIMERA_CHECK(std::find(free_slots_.begin(), free_slots_.end(), slot) == free_slots_.end(),
                "slot {} released twice", slot);
  free_slots_.push_back(slot);
}

bool StateCache::reserve_blocks(std::vector<int32_t>& blocks, int32_t num_tokens) {
  const int32_t need = (num_tokens + sizes_.block_size - 1) / sizes_.block_size;
  const int32_t more = need - static_cast<int32_t>(blocks.size());
  if (more <= 0) return true;
  if (need > blocks_per_seq()) return false;
  return blocks_.take(more, blocks);
}

void StateCache::release_blocks(std::vector<int32_t>& blocks) {
  blocks_.release(blocks);
  blocks.clear();
}

bool StateCache::has_mamba() const {
  return std::any_of(state_.conv.begin(), state_.conv.end(), [](const Tensor& t) { return static_cast<bool>(t); });
}

void StateCache::copy_mamba_state(int32_t dst, int32_t src, void* stream) {
  const StateOp op{StateOp::kCopySlot, dst, src};
  for_each_rank([&](int r, const ModelState& st) {
    // A rank on another GPU than the stream's (rank 0's): a synchronous copy on its own device.
    const bool other_gpu = rank_device(r) != rank_device(0);
    apply_state_op(op, st, device_ == Device::kCpu || other_gpu ? nullptr : stream);
  });
  if (sizes_.log_state_ops) state_.remote_ops.push_back(op);
}

void apply_state_op(const StateOp& op, const ModelState& st, void* stream) {
  for (size_t i = 0; i < st.conv.size(); ++i) {
    if (!st.conv[i]) continue;
    for (const Tensor& t : {st.conv[i], st.ssm[i]}) {
      if (op.kind == StateOp::kZeroSlot) {
        device::zero(t.select(op.dst));
      } else if (stream == nullptr) {
        device::copy(t.select(op.dst), t.select(op.src));
      } else {
        device::copy_async(t.select(op.dst), t.select(op.src), stream);
      }
    }
  }
}

size_t StateCache::bytes() const {
  size_t b = 0;
  for_each_rank([&](int, const ModelState& st) {
    for (size_t i = 0; i < st.conv.size(); ++i) {
      if (st.conv[i]) b += st.conv[i].nbytes() + st.ssm[i].nbytes();
      if (st.kv[i].k) b += st.kv[i].k.nbytes() + st.kv[i].v.nbytes();
    }
  });
  return b;
}

size_t StateCache::mamba_state_bytes_per_seq(const ModelConfig& c, DType ssm_dtype) {
  const size_t per_layer = static_cast<size_t>(c.conv_dim() * (c.conv_kernel - 1)) * 4 +
                           static_cast<size_t>(c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size) *
                               dtype_size(ssm_dtype);
  return per_layer * static_cast<size_t>(std::count(c.layers.begin(), c.layers.end(), LayerKind::kMamba));
}

size_t StateCache::kv_bytes_per_token(const ModelConfig& c, size_t bytes_per_element) {
  const size_t per_layer = static_cast<size_t>(2 * c.num_key_value_heads * c.head_dim) * bytes_per_element;
  return per_layer * static_cast<size_t>(std::count(c.layers.begin(), c.layers.end(), LayerKind::kAttention));
}

std::vector<LayerKind> mtp_cache_layers(const ModelConfig& config) {
  std::vector<LayerKind> kinds;
  for (int64_t b = 0; b < config.num_nextn_predict_layers; ++b) {
    kinds.insert(kinds.end(), config.mtp_layers.begin(), config.mtp_layers.end());
  }
  return kinds;
}

DType parse_ssm_cache_dtype(const std::string& name, const std::string& what) {
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16") return DType::kF16;
  invalid_input("{} '{}' is not a Mamba SSM cache dtype (float32, bfloat16 or float16)", what, name);
}

const char* ssm_cache_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    default: return "unsupported";
  }
}

}  // namespace chimera
