// Depthwise causal conv1d of the Mamba-2 mixer (docs/model.md 3.3, 3.5), channel-last layout:
//   out[t, c] = act( bias[c] + sum_{j<K} w[c, j] * hist[t + j, c] ),  hist = conv_state[slot, c, :] ++ x[:, c]
// over a packed varlen batch (prefill), and the one-token update for a batch of slots (decode). The conv
// state keeps the K-1 inputs preceding the next token (vLLM / TRT-LLM layout [num_slots, C, K-1]).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"

namespace chimera::cuda {

// One prefill tile: up to kConv1dTileRows tokens of one sequence.
struct Conv1dTile {
  int32_t row_begin;  // the sequence's first row in the packed batch
  int32_t len;        // the sequence's length
  int32_t t0;         // first token of the tile, relative to the sequence start (a multiple of kConv1dTileRows)
  int32_t slot;       // the sequence's conv state slot (>= 0)
};
inline constexpr int kConv1dTileRows = 32;

struct Conv1dParams {
  const void* x;       // [T, C] act dtype (prefill: packed rows; update: one row per slot)
  void* out;           // [T, C] act dtype
  const void* weight;  // [C, K] weight_dtype (the checkpoint's [C, 1, K] is the same memory)
  const void* bias;    // [C] bias_dtype, or nullptr
  void* conv_state;    // [num_slots, C, K-1] state_dtype
  DType act = DType::kF32, weight_dtype = DType::kF32, bias_dtype = DType::kF32, state_dtype = DType::kF32;
  int64_t C = 0;
  int K = 0;
  bool silu = true;
  // Set by the launchers: weight (and bias) in the activation dtype and 16-byte aligned -> vector tap loads.
  bool taps_vec = false;
  // prefill
  const Conv1dTile* tiles = nullptr;  // [n_tiles] device
  // The kernel reads its tile before pdl_wait() (launch.cuh): the list is host-built metadata copied to the device
  // before the launch, which no kernel writes.
  int n_tiles = 0;
  // update
  const int32_t* slots = nullptr;  // [batch] device; slot < 0: row skipped
  // [batch] device, or nullptr (in place): row b's shifted window goes to slot dst_slots[b] (ops.h), read with the
  // slots before pdl_wait() for the same reason.
  const int32_t* dst_slots = nullptr;
  // The kernel reads the slot ids before pdl_wait() (launch.cuh): they are step metadata that no kernel of the step
  // writes (ops::Indices: host values, or a device copy of them made before the step). That takes the slot
  // look-up's round trip off the path slot -> state address -> state loads.
  int batch = 0;
};

// A conv state checkpoint (ops::StateCheckpoint) as the kernel reads it.
struct Conv1dCheckpoint {
  int32_t row_begin;  // the sequence's first row in the packed batch
  int32_t rows;       // the cut: the state holds the K-1 inputs before the sequence's row `rows`
  int32_t src_slot;   // the sequence's slot (its state before the call: the inputs left of a cut under K-1 rows in)
  int32_t dst_slot;   // the checkpoint's slot
};
// Writes each checkpoint's window from x and the sequences' states before the call; launched ahead of the prefill,
// which overwrites those states (same stream, no programmatic overlap). p: x, conv_state, dtypes, C and K.
void launch_conv1d_checkpoints(const Conv1dParams& p, const Conv1dCheckpoint* checkpoints, int n, cudaStream_t stream);

// Tiles of a packed batch: every non-pad, non-empty sequence cut into kConv1dTileRows-token tiles.
std::vector<Conv1dTile> conv1d_tiles(std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots);

// Prefill over p.tiles (at most 65535 tiles: ~2M tokens per call). K in {2, 3, 4}; 16-byte vector path when
// x / out are 16-byte aligned and C is a multiple of the vector width, else element-wise. out must not
// overlap x (tiles read their left neighbours).
void launch_causal_conv1d(const Conv1dParams& p, cudaStream_t stream);
// Decode update over p.slots (p.batch rows). K in {2, 3, 4}. out may alias x.
void launch_causal_conv1d_update(const Conv1dParams& p, cudaStream_t stream);

}  // namespace chimera::cuda
