// Per-sequence state that lives outside the model (docs/architecture.md "State caches"):
//   * Mamba state slots: per Mamba layer a conv state [slots, conv_dim, conv_kernel - 1] and an SSM state
//     [slots, mamba_num_heads, mamba_head_dim, ssm_state_size] in CacheSizes::ssm_dtype (F32 by default; BF16 or F16
//     with --mamba-ssm-cache-dtype: half the bytes, so twice the slots fit). A sequence owns one slot id across all
//     Mamba layers. The conv state has the activation dtype (F32 on the CPU, bf16 / fp32 on CUDA).
//   * Paged KV cache: per attention layer K and V blocks [num_blocks, block_size, num_key_value_heads,
//     head_dim] in the activation dtype, or FP8 E4M3 with per-tensor scales (CacheSizes::kv_cache_fp8,
//     --kv-cache-dtype fp8: one byte an element), handed out in blocks and addressed through per-sequence block
//     tables.
//   * Past both, num_pad scratch slots and blocks for CUDA-graph pad rows: slots = max_seqs + num_pad, blocks =
//     num_blocks + num_pad; sizes(), the free lists and the load figures count only the sequences' part. With
//     speculative decoding, max_seqs * spare_slots more slots after the pad slots (CacheSizes::spare_slots); with
//     prefix caching, CacheSizes::checkpoint_slots more after those for the Mamba checkpoints (runtime/prefix_cache.h).
//   * With prefix caching the KV blocks are reference counted and published under a hash chain (BlockPool), so
//     sequences with a common prefix share them and a finished sequence's blocks stay for the next request.
// Everything lives on the device the model runs on (device::empty, zeroed with device::zero).
// The runtime allocates and frees; the model only reads and writes through slot ids and block tables.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/device_api.h"
#include "io/model_config.h"
#include "ops/ops.h"
#include "runtime/prefix_cache.h"

namespace chimera {

// A state operation the runtime makes on the caches outside a forward step (StateCache::allocate_slot's zeroing,
// copy_mamba_state), as a record for ranks in other processes (CacheSizes::log_state_ops).
struct StateOp {
  enum Kind : int32_t { kZeroSlot = 1, kCopySlot = 2 };
  int32_t kind = kZeroSlot;
  int32_t dst = 0;  // the slot zeroed, or copied to
  int32_t src = 0;  // kCopySlot: the slot copied from
};

// What one forward step sees of the caches; indexed by layer (entries of other layer kinds are empty).
struct ModelState {
  std::vector<Tensor> conv;             // Mamba layers: [slots, Cd, K-1], activation dtype
  std::vector<Tensor> ssm;              // Mamba layers: [slots, H, P, N] in CacheSizes::ssm_dtype
  std::vector<ops::KvCacheView> kv;     // attention layers, activation dtype
  // Tensor parallelism (CacheSizes::tensor_parallel_size): the other ranks' caches, peers[r - 1] rank r's, each
  // shaped like this one (every rank holds the same number of heads), with the same slot and block ids.
  std::vector<ModelState> peers;
  // CacheSizes::log_state_ops: the state operations made since the last step, in order; the model sends them to
  // the ranks in other processes with the next step and clears them (models/tensor_parallel_model.h).
  std::vector<StateOp> remote_ops;
  // Distinct for every StateCache of the process (0: none): a model whose ranks in other processes hold copies of
  // these caches sends them the layout again when it sees another one (a command that makes several engines).
  uint64_t layout_id = 0;
};

// Applies `op` to one rank's caches: a copy at once without a stream (the host, or a rank on another GPU than the
// stream's), else ordered on `stream`.
void apply_state_op(const StateOp& op, const ModelState& state, void* stream = nullptr);

struct CacheSizes {
  int32_t max_seqs = 8;        // Mamba state slots
  int32_t max_model_len = 4096;  // tokens per sequence (prompt + generated)
  int32_t block_size = 16;     // KV tokens per block
  // KV blocks in the pool; 0 = enough for max_seqs sequences of max_model_len tokens. At least one sequence of
  // max_model_len tokens (kInvalidInput otherwise); below max_seqs of them the scheduler preempts.
  int32_t num_blocks = 0;
  // Scratch Mamba slots and KV blocks for the pad rows of CUDA-graph decode steps (Engine sets it: the largest
  // number of pad rows one graph bucket can carry, cuda_graph_pad_rows in runtime/cache_sizing.h). They come after
  // the max_seqs slots and the num_blocks blocks, are never in the free lists, and start zeroed, so every pad row
  // of a step owns its own state and block.
  int32_t num_pad = 0;
  // The SSM state's dtype: F32, BF16 (rounded to nearest even) or F16 (stochastic rounding), ops.h SsmParams.
  DType ssm_dtype = DType::kF32;
  // --kv-cache-dtype fp8: K and V stored as F8_E4M3 (ops.h KvCacheView; the views' scales start at 1); false
  // ("auto"): the activation dtype.
  bool kv_cache_fp8 = false;
  // The MTP head's caches too: its attention sublayers' KV (same blocks and block tables as the backbone's: the
  // head's position t is the backbone's) at state index config.layers.size() + f, f the sublayer in mtp.layers.f.
  // Off: the head cannot run, and its KV costs nothing.
  bool mtp = false;
  // Speculative decoding (runtime/engine.h): Mamba slots each sequence holds besides its own, one per row of a verify
  // step (K + 1 for K draft tokens), where the step leaves the state after each row. Accepting a prefix makes that
  // row's slot the sequence's own and the old one a spare (no copy). They follow the pad slots; max_seqs *
  // (1 + spare_slots) slots in the sequences' part.
  int32_t spare_slots = 0;
  // Prefix caching (runtime/prefix_cache.h): KV blocks published and shared by their hash chain, and
  // checkpoint_slots Mamba slots (after the spare ones) that hold the Mamba state after a prefix of
  // checkpoint_interval x k tokens (a multiple of block_size). Off: blocks are a plain free list.
  bool prefix_caching = false;
  int32_t checkpoint_slots = 0;
  int32_t checkpoint_interval = 2048;
  // Tensor parallelism with ranks that are threads (models/tensor_parallel_model.h): the cache is made from the
  // rank-local config and holds tensor_parallel_size copies of every tensor (ModelState::peers), one per local rank,
  // under one set of slot and block ids; zeroing a new slot and copy_mamba_state apply to every copy.
  int32_t tensor_parallel_size = 1;
  // CUDA ranks on several GPUs: rank r's copy lives on GPU rank_devices[r] (tensor_parallel_size entries); empty:
  // every copy on the current GPU.
  std::vector<int> rank_devices;
  // Ranks in other processes hold the same caches (TensorParallelModel over a dist::HostGroup of several nodes): every
  // zeroing and copy_mamba_state is also logged in state().remote_ops for them.
  bool log_state_ops = false;
};

// The MTP head's sublayers in cache order (CacheSizes::mtp): its block's pattern, once per block.
std::vector<LayerKind> mtp_cache_layers(const ModelConfig& config);

// --mamba-ssm-cache-dtype: "float32", "bfloat16" or "float16" (vLLM's names); kInvalidInput naming `what` otherwise.
DType parse_ssm_cache_dtype(const std::string& name, const std::string& what);
// The flag's spelling of a dtype ("float32", ...).
const char* ssm_cache_dtype_name(DType dtype);

class StateCache {
 public:
  // `device`: where the caches live; `act_dtype`: the model's activation dtype (conv state and KV cache).
  StateCache(const ModelConfig& config, const CacheSizes& sizes, Device device = Device::kCpu,
             DType act_dtype = DType::kF32);

  const CacheSizes& sizes() const { return sizes_; }
  Device device() const { return device_; }
  int32_t blocks_per_seq() const { return (sizes_.max_model_len + sizes_.block_size - 1) / sizes_.block_size; }

  // A fresh Mamba slot, zeroed in every layer (a new sequence starts from zero state) unless `zeroed` is false (a
  // slot about to be overwritten by a checkpoint). -1 when none is free.
  int32_t allocate_slot(bool zeroed = true);
  // CacheSizes::spare_slots more slots for a sequence, not zeroed (a verify step writes a slot before reading it);
  // empty when the pool is short. Spare and own slots come from one pool and are released alike.
  std::vector<int32_t> allocate_spare_slots();
  void release_slot(int32_t slot);
  // Sequences' worth of free slots (each sequence holds 1 + spare_slots).
  int32_t free_slots() const { return static_cast<int32_t>(free_slots_.size()) / (1 + sizes_.spare_slots); }

  // Grows `blocks` so that it covers `num_tokens` tokens. False (and nothing taken) if the pool is short.
  bool reserve_blocks(std::vector<int32_t>& blocks, int32_t num_tokens);
  void release_blocks(std::vector<int32_t>& blocks);
  // Blocks a reservation can take: free ones and cached ones nobody holds (evicted as needed).
  int32_t free_blocks() const { return blocks_.num_free(); }
  BlockPool& block_pool() { return blocks_; }
  const BlockPool& block_pool() const { return blocks_; }

  // Prefix caching's Mamba checkpoints (slot ids of their own pool).
  CheckpointPool& checkpoints() { return checkpoints_; }
  const CheckpointPool& checkpoints() const { return checkpoints_; }
  // Copies slot src's Mamba state (conv and SSM, every Mamba layer) to slot dst, ordered on `stream` (CUDA; the
  // host copies at once).
  void copy_mamba_state(int32_t dst, int32_t src, void* stream);

  // Pad row j's scratch Mamba slot and KV block (0 <= j < sizes().num_pad).
  int32_t pad_slot(int32_t j) const;
  int32_t pad_block(int32_t j) const;

  // Whether the model has Mamba layers (their state needs checkpoints to be restored).
  bool has_mamba() const;
  ModelState& state() { return state_; }
  // Bytes held by all caches (for `chimera info` and memory planning).
  size_t bytes() const;
  // Bytes of Mamba state per sequence and of KV per token, from the config alone.
  static size_t mamba_state_bytes_per_seq(const ModelConfig& config, DType ssm_dtype = DType::kF32);
  static size_t kv_bytes_per_token(const ModelConfig& config, size_t bytes_per_element = 4);

 private:
  // fn(rank, its state) for this rank's state (rank 0) and each peer's (CacheSizes::tensor_parallel_size), each
  // with its rank's GPU current (CacheSizes::rank_devices).
  template <typename Fn>
  void for_each_rank(Fn fn) const {
    for (int r = 0; r <= static_cast<int>(state_.peers.size()); ++r) {
      const device::DeviceGuard on(rank_device(r));
      fn(r, r == 0 ? state_ : state_.peers[static_cast<size_t>(r - 1)]);
    }
  }
  int rank_device(int r) const {
    return sizes_.rank_devices.empty() ? -1 : sizes_.rank_devices[static_cast<size_t>(r)];
  }
  CacheSizes sizes_;
  Device device_;
  ModelState state_;
  std::vector<int32_t> free_slots_;   // a stack; lowest ids handed out first
  BlockPool blocks_;
  CheckpointPool checkpoints_;
};

}  // namespace chimera
