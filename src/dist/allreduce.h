// The AllReduce the model calls once per layer, with the next layer's norm fused in (cross-layer
// fusion): sum the row-parallel partial outputs over the tensor-parallel ranks, add the residual, RMSNorm,
// optionally quantise to FP8, in one kernel where the strategy allows (ONESHOT, TWOSHOT) or as ncclAllReduce +
// one fused epilogue kernel (NCCL).
//
//   auto comm = Communicator::create_local({0, 1});
//   AllReduceFusion ar(*comm, detect_topology(comm->devices()), AllReduceConfig{});
//   comm->run_ranks([&](int rank) { ... ar.run(rank, params, stream_of[rank]); ... });
//
// Contract: every rank calls run with the same shape, dtype and pattern, in the same order (the strategy is a
// function of those, so all ranks take the same one), each rank on its own stream. ONESHOT and TWOSHOT calls
// can be captured in a CUDA graph and replayed (their state lives in device memory); an NCCL call can be
// captured when NCCL supports it and its scratch was already sized by an earlier call of the same size.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/dtype.h"
#include "dist/allreduce_types.h"
#include "dist/communicator.h"
#include "dist/strategy.h"
#include "dist/topology.h"

namespace chimera::dist {

struct AllReduceConfig {
  // Forced strategy; kAuto asks the offline-tuned lookup table (strategy.h), a fixed function of the call's shape. Set from the CLI (--allreduce-strategy, or the
  // CHIMERA_ALLREDUCE_STRATEGY environment variable, read once there); never read from the environment here.
  AllReduceStrategy strategy = AllReduceStrategy::kAuto;
  // Workspace capacity per message: max tokens x hidden x element size (64 MiB default). Each rank allocates
  // 3 x n_ranks x this (Lamport) + n_ranks x this (TWOSHOT staging, sums). Larger messages go to NCCL.
  int64_t max_message_bytes = int64_t{64} << 20;
};

// One call. Tensors are [tokens, hidden] row-major, contiguous, 16-byte aligned, in `dtype` (bf16, fp16, fp32),
// except norm_weight [hidden] in `dtype` and fp8_out [tokens, hidden] e4m3. Unused pointers may be null.
struct AllReduceParams {
  FusionPattern pattern = FusionPattern::kResidualRmsNorm;
  DType dtype = DType::kBF16;
  int64_t tokens = 0;
  int64_t hidden = 0;
  const void* input = nullptr;        // this rank's partial sum
  const void* residual_in = nullptr;  // has_residual
  void* residual_out = nullptr;       // has_residual (may equal residual_in: updated in place)
  void* norm_out = nullptr;           // has_norm_out
  void* fp8_out = nullptr;            // has_fp8_out: e4m3(norm * w / fp8_scale), saturated to +-448
  void* output = nullptr;             // kAllReduce: the sum
  const void* norm_weight = nullptr;  // has_norm
  float eps = 1e-5f;
  float fp8_scale = 1.0f;             // per-tensor dequantisation scale of fp8_out
};

class AllReduceFusion {
 public:
  // Allocates and peer-maps the workspace of every local rank when all pairs have peer access and this process
  // drives every rank; otherwise only NCCL is used.
  AllReduceFusion(const Communicator& comm, const Topology& topology, AllReduceConfig config);
  ~AllReduceFusion();
  AllReduceFusion(const AllReduceFusion&) = delete;
  AllReduceFusion& operator=(const AllReduceFusion&) = delete;

  // From local rank `rank`'s thread; stream: that rank's cudaStream_t. Returns the strategy that ran.
  AllReduceStrategy run(int rank, const AllReduceParams& params, void* stream);
  // The strategy run() would take (never kAuto).
  AllReduceStrategy choose(const AllReduceParams& params) const;
  bool custom_kernels_available() const { return custom_; }
  const AllReduceConfig& config() const { return config_; }

 private:
  struct RankState;
  StrategyQuery query(const AllReduceParams& params) const;  // what the strategy choice depends on
  AllReduceStrategy launch(int rank, const AllReduceParams& p, AllReduceStrategy s, void* stream);
  const Communicator& comm_;
  AllReduceConfig config_;
  bool custom_ = false;
  std::vector<std::unique_ptr<RankState>> ranks_;
};

}  // namespace chimera::dist
