#include "dist/allreduce.h"

#include <cuda_runtime.h>

#include "backends/cuda/dist/allreduce_kernels.h"
#include "core/error.h"
#include "dist/strategy.h"

namespace chimera::dist {

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) runtime_error("dist::AllReduceFusion: {} failed: {}", what, cudaGetErrorString(e));
}

constexpr int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    default: invalid_input("dist::AllReduceFusion: dtype {} is not supported (supported: F32, BF16, F16)", dtype_name(t));
  }
}

void require(const void* p, bool needed, const char* name, FusionPattern pattern) {
  if (needed && !p) invalid_input("dist::AllReduceFusion: pattern {} needs {}", pattern_name(pattern), name);
}

}  // namespace

// One rank's workspace (one cudaMalloc, peer-mapped by every other rank):
//   lamport  [3][n_ranks][M]   pre-filled with the empty pattern
//   staging  [n_ranks - 1][M]  TWOSHOT: the peers' parts of this rank's shares
//   reduced  [M]               TWOSHOT: the sums
//   flags    [kMaxBlocks][kMaxRanks] u32, epochs [kMaxBlocks] u32, LamportBlockState [kOneShotGrid]
struct AllReduceFusion::RankState {
  void* workspace = nullptr;
  cuda::dist::PeerArgs peers{};
  void* scratch = nullptr;  // NCCL path, when no output can hold the sum
  int64_t scratch_bytes = 0;
};

AllReduceFusion::AllReduceFusion(const Communicator& comm, const Topology& topology, AllReduceConfig config)
    : comm_(comm), config_(config) {
  const int n = comm.size();
  // < 2^35 bytes: the TWOSHOT kernel indexes a message's 16-byte vectors in 32 bits.
  if (config_.max_message_bytes <= 0 || config_.max_message_bytes % 16 != 0 ||
      config_.max_message_bytes >= (int64_t{1} << 35)) {
    invalid_input("dist::AllReduceFusion: max_message_bytes {} must be a positive multiple of 16 below 32 GiB",
                  config_.max_message_bytes);
  }
  for (int r = 0; r < comm.local_ranks(); ++r) ranks_.push_back(std::make_unique<RankState>());
  custom_ = topology.all_peer_access() && comm.local_ranks() == n && n >= 2 && n <= kMaxRanks &&
            topology.size() == n;
  if (!custom_) return;

  const int64_t m = config_.max_message_bytes;
  const int64_t lamport_bytes = int64_t{kLamportSlots} * n * m;
  const int64_t staging_off = lamport_bytes, reduced_off = staging_off + int64_t{n - 1} * m, flags_off = reduced_off + m;
  const int64_t epochs_off = align_up(flags_off + int64_t{kMaxBlocks} * kMaxRanks * 4, 256);
  const int64_t blocks_off = align_up(epochs_off + int64_t{kMaxBlocks} * 4, 256);
  const int64_t total =
      align_up(blocks_off + int64_t{kOneShotGrid} * static_cast<int64_t>(sizeof(cuda::dist::LamportBlockState)), 256);

  for (int r = 0; r < n; ++r) {
    RankState& rs = *ranks_[static_cast<size_t>(r)];
    cuda_check(cudaSetDevice(comm.device(r)), "cudaSetDevice");
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(comm.device(q), 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // clear the sticky-free error state
      } else {
        cuda_check(e, "cudaDeviceEnablePeerAccess");
      }
    }
    cuda_check(cudaMalloc(&rs.workspace, static_cast<size_t>(total)), "cudaMalloc(workspace)");
    char* base = static_cast<char*>(rs.workspace);
    cuda_check(cudaMemset(base + flags_off, 0, static_cast<size_t>(total - flags_off)), "cudaMemset(flags)");
    cuda::dist::launch_lamport_fill(base, static_cast<size_t>(lamport_bytes), nullptr);
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize(workspace init)");
  }
  for (int r = 0; r < n; ++r) {
    cuda::dist::PeerArgs& p = ranks_[static_cast<size_t>(r)]->peers;
    p.rank = r;
    p.n_ranks = n;
    p.lamport_stride_bytes = m;
    for (int q = 0; q < n; ++q) {
      char* base = static_cast<char*>(ranks_[static_cast<size_t>(q)]->workspace);
      p.lamport[q] = base;
      p.staging[q] = base + staging_off;
      p.reduced[q] = base + reduced_off;
      p.flags[q] = reinterpret_cast<uint32_t*>(base + flags_off);
    }
    char* mine = static_cast<char*>(ranks_[static_cast<size_t>(r)]->workspace);
    p.epochs = reinterpret_cast<uint32_t*>(mine + epochs_off);
    p.lamport_blocks = reinterpret_cast<cuda::dist::LamportBlockState*>(mine + blocks_off);
  }
}

AllReduceFusion::~AllReduceFusion() {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    cudaSetDevice(comm_.device(static_cast<int>(r)));
    cudaDeviceSynchronize();
    if (ranks_[r]->workspace) cudaFree(ranks_[r]->workspace);
    if (ranks_[r]->scratch) cudaFree(ranks_[r]->scratch);
  }
}

StrategyQuery AllReduceFusion::query(const AllReduceParams& p) const {
  StrategyQuery q;
  q.n_ranks = comm_.size();
  q.pattern = p.pattern;
  q.hidden = p.hidden;
  q.tokens = p.tokens;
  q.elem_bytes = static_cast<int>(dtype_size(p.dtype));
  q.peer_access = custom_;
  q.max_message_bytes = config_.max_message_bytes;
  return q;
}

AllReduceStrategy AllReduceFusion::choose(const AllReduceParams& p) const {
  return select_strategy(query(p), config_.strategy);
}

AllReduceStrategy AllReduceFusion::run(int rank, const AllReduceParams& p, void* stream) {
  if (rank < 0 || rank >= comm_.local_ranks()) invalid_input("dist::AllReduceFusion: rank {} out of range", rank);
  if (p.tokens <= 0 || p.hidden <= 0) invalid_input("dist::AllReduceFusion: empty shape {} x {}", p.tokens, p.hidden);
  const FusionPattern pat = p.pattern;
  require(p.input, true, "input", pat);
  require(p.residual_in, has_residual(pat), "residual_in", pat);
  require(p.residual_out, has_residual(pat), "residual_out", pat);
  require(p.norm_out, has_norm_out(pat), "norm_out", pat);
  require(p.fp8_out, has_fp8_out(pat), "fp8_out", pat);
  require(p.output, pat == FusionPattern::kAllReduce, "output", pat);
  require(p.norm_weight, has_norm(pat), "norm_weight", pat);
  (void)nccl_type(p.dtype);  // the dtype check, before any strategy runs
  if (has_fp8_out(pat) && !(p.fp8_scale > 0.0f)) invalid_input("dist::AllReduceFusion: fp8_scale must be > 0");

  return launch(rank, p, choose(p), stream);
}

AllReduceStrategy AllReduceFusion::launch(int rank, const AllReduceParams& p, AllReduceStrategy s, void* stream) {
  const FusionPattern pat = p.pattern;
  const ncclDataType_t type = nccl_type(p.dtype);
  cuda::dist::FusionArgs a{};
  a.input = p.input;
  a.residual_in = p.residual_in;
  a.residual_out = p.residual_out;
  a.norm_out = p.norm_out;
  a.fp8_out = p.fp8_out;
  a.output = p.output;
  a.norm_weight = p.norm_weight;
  a.eps = p.eps;
  a.fp8_inv_scale = 1.0f / p.fp8_scale;
  a.tokens = p.tokens;
  a.hidden = static_cast<int>(p.hidden);

  RankState& rs = *ranks_[static_cast<size_t>(rank)];
  switch (s) {
    case AllReduceStrategy::kOneShot:
      cuda::dist::launch_oneshot(p.dtype, pat, a, rs.peers, stream);
      return s;
    case AllReduceStrategy::kTwoShot: cuda::dist::launch_twoshot(p.dtype, pat, a, rs.peers, stream); return s;
    default: break;
  }

  // NCCL: the sum lands where the epilogue can read it and then overwrite it (output, norm_out, residual_out
  // when it is not the residual input), else in a per-rank scratch buffer.
  const int64_t bytes = p.tokens * p.hidden * static_cast<int64_t>(dtype_size(p.dtype));
  void* sum = nullptr;
  if (pat == FusionPattern::kAllReduce) {
    sum = p.output;
  } else if (has_norm_out(pat) && p.norm_out != p.residual_in) {
    sum = p.norm_out;
  } else if (has_residual(pat) && p.residual_out != p.residual_in) {
    sum = p.residual_out;
  } else {
    if (rs.scratch_bytes < bytes) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      cuda_check(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capturing), "cudaStreamIsCapturing");
      if (capturing != cudaStreamCaptureStatusNone) {
        runtime_error("dist::AllReduceFusion: the NCCL path needs {} bytes of scratch during graph capture; run "
                      "one call of this size before capturing", bytes);
      }
      if (rs.scratch) cuda_check(cudaFree(rs.scratch), "cudaFree(scratch)");
      cuda_check(cudaMalloc(&rs.scratch, static_cast<size_t>(bytes)), "cudaMalloc(scratch)");
      rs.scratch_bytes = bytes;
    }
    sum = rs.scratch;
  }
  nccl_check(ncclAllReduce(p.input, sum, static_cast<size_t>(p.tokens * p.hidden), type, ncclSum,
                           comm_.nccl(rank), static_cast<cudaStream_t>(stream)),
             "ncclAllReduce");
  a.input = sum;
  cuda::dist::launch_fused_norm(p.dtype, pat, a, stream);
  return AllReduceStrategy::kNccl;
}

}  // namespace chimera::dist
