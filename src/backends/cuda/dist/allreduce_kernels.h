// Launchers of the fused AllReduce kernels (src/backends/cuda/dist/*.cu). Plain params structs, no framework
// types; included by the host code in src/dist (compiled as C++), so no CUDA types appear here either: streams
// travel as void* (cudaStream_t).
//
// Every kernel keeps one row (token) of `hidden` elements in fp32 registers from the sum to the last store:
// one block a row at a time (row t -> block t % grid), 16-byte vectors, blockDim = min(1024, vectors a row).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "dist/allreduce_index.h"
#include "dist/allreduce_types.h"

namespace chimera::cuda::dist {

using chimera::dist::FusionPattern;
using chimera::dist::kMaxRanks;

// The per-call tensors. All [tokens, hidden] in `dtype` unless said; null where the pattern does not use them.
struct FusionArgs {
  const void* input;        // this rank's partial sum (ONESHOT, TWOSHOT) or the full sum (the NCCL epilogue)
  const void* residual_in;  // has_residual
  void* residual_out;       // has_residual; may alias residual_in
  void* norm_out;           // has_norm_out; may alias input for the NCCL epilogue (read before written)
  void* fp8_out;            // has_fp8_out: [tokens, hidden] e4m3
  void* output;             // kAllReduce: the sum
  const void* norm_weight;  // [hidden] dtype
  float eps;
  float fp8_inv_scale;  // fp8_out = e4m3(clamp(norm * fp8_inv_scale, +-448)); the per-tensor scale is 1 / this
  int64_t tokens;
  int hidden;
};

// Per-block Lamport state of the ONESHOT kernel, [kOneShotGrid] in each rank's workspace (local; never touched by
// peers).
// Block b alone reads and writes entry b; every block advances its slot once per call, so all stay equal.
struct LamportBlockState {
  uint32_t slot;          // the slot this block's next call reads (0..2)
  uint32_t pad;
  uint64_t used_vecs[3];  // message vectors (per source rank) of the call that read each slot: block b clears
                          // oneshot_chunk(b, kOneShotGrid, used_vecs[s]) of every source region of slot s
};

// Each rank's view of the peer-mapped workspaces (pointers valid on this rank's device: cudaDeviceEnablePeerAccess).
struct PeerArgs {
  int rank;
  int n_ranks;
  void* lamport[kMaxRanks];       // [3][n_ranks][slot_stride_bytes] each, pre-filled with the empty pattern
  int64_t lamport_stride_bytes;   // bytes of one rank's region in one slot (= max message bytes); also the
                                  // bytes of one TWOSHOT staging region
  LamportBlockState* lamport_blocks;  // this rank's, [kOneShotGrid] (ONESHOT)
  void* staging[kMaxRanks];       // TWOSHOT: every rank's [n_ranks - 1][max message bytes] regions, where the
                                  // peers push their parts of its shares (twoshot_staging_region)
  void* reduced[kMaxRanks];       // TWOSHOT: every rank's buffer of sums, [max message bytes]
  uint32_t* flags[kMaxRanks];     // TWOSHOT barrier flags of every rank: [kMaxBlocks][kMaxRanks] epochs
  uint32_t* epochs;               // TWOSHOT: this rank's barrier count per block, [kMaxBlocks]
};

// ONESHOT (Lamport protocol): push the input to every peer's Lamport slot, spin on the local slot until every
// rank's data is there, sum in rank order, fuse. One kernel on a fixed grid of kOneShotGrid blocks, each with its
// own slot counter; launched with programmatic dependent launch when device::pdl_enabled(); graph-capturable
// (the slots live in device memory).
void launch_oneshot(DType dtype, FusionPattern pattern, const FusionArgs& args, const PeerArgs& peers,
                    void* stream);
// TWOSHOT (explicit barriers): push each peer's share of the input into its staging buffer, barrier, reduce this rank's
// share of every row and write it to all ranks, barrier, fuse from the local buffer. One kernel, launched with
// programmatic dependent launch when device::pdl_enabled(); graph-capturable.
void launch_twoshot(DType dtype, FusionPattern pattern, const FusionArgs& args, const PeerArgs& peers,
                    void* stream);
// The NCCL path's epilogue: args.input already holds the full sum; residual add + RMSNorm (+ FP8) in one pass.
// kAllReduce has nothing to do (NCCL wrote the output).
void launch_fused_norm(DType dtype, FusionPattern pattern, const FusionArgs& args, void* stream);
// Fills `bytes` (a multiple of 4) at `buffer` with the Lamport empty pattern.
void launch_lamport_fill(void* buffer, size_t bytes, void* stream);

}  // namespace chimera::cuda::dist
