// The CUDA adapters of ops::ssd_chunk_scan (SsdRunner) and ops::ssm_recurrence: plan the chunk grid of the
// packed batch on the host, upload it, take an fp32 workspace, pick the kernel instances from the dtypes and
// launch the stages of ssd_kernels.cuh on ctx.stream.
//
// Path choice: bf16 / f16 activations at P = 64, N = 128, chunk 128 with 16-byte aligned rows run the
// tensor-core stages (ssd_mma.cu); everything else (F32 activations, other shapes) the portable fp32 ones.
// The tensor-core scan groups M consecutive chunks of a sequence into a superchunk (see ssd_kernels.cuh);
// M grows while the grid still fills the GPU several times over.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/mamba/ssd_kernels.cuh"
#include "backends/device_api.h"

namespace chimera::cuda {
namespace {

constexpr int kMaxSuperchunk = 16;

ParamType param_type(const Tensor& t, const char* op, const char* name) {
  switch (t.dtype()) {
    case DType::kF32:
      return ParamType::kF32;
    case DType::kBF16:
      return ParamType::kBF16;
    case DType::kF16:
      return ParamType::kF16;
    default:
      throw_runtime(str_cat(op, ": ", name, " ", t.describe(), " must be F32, BF16 or F16"));
  }
}

// x, y, dt_raw, B, C share one activation dtype on CUDA.
void check_one_dtype(const char* op, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                     const Tensor& C) {
  for (const Tensor* t : {&y, &dt_raw, &B, &C}) {
    if (t->dtype() != x.dtype()) {
      throw_runtime(str_cat(op, ": CUDA needs one activation dtype per call, but x is ", x.describe(), ", y ",
                            y.describe(), ", dt_raw ", dt_raw.describe(), ", B ", B.describe(), ", C ",
                            C.describe()));
    }
  }
}

// One fp32 device buffer carved into 16-byte aligned pieces: reserve() them all, allocate(), then at(i).
// It goes back to the caching allocator when the adapter returns; the stream orders its reuse.
class Workspace {
 public:
  size_t reserve(size_t floats) {
    offsets_.push_back(size_);
    size_ += (floats + 3) / 4 * 4;
    return offsets_.size() - 1;
  }
  Tensor allocate() {
    buf_ = device::empty(Device::kCuda, DType::kF32, {static_cast<int64_t>(std::max<size_t>(size_, 4))});
    return buf_;
  }
  float* at(size_t i) const { return buf_.data_as<float>() + offsets_[i]; }

 private:
  size_t size_ = 0;
  std::vector<size_t> offsets_;
  Tensor buf_;
};

// The host-side plan: chunk table, superchunk table, sequence table, packed into one int32 upload.
struct Plan {
  std::vector<int32_t> chunks;  // pairs {begin, end}
  std::vector<int32_t> supers;  // pairs {first chunk, count}
  std::vector<int32_t> seqs;    // quads {first super, end super, slot, position of the last token}
  std::vector<int32_t> super_checkpoints;  // pairs {slot, position before}, one per super; empty: no checkpoints
  int n_chunks() const { return static_cast<int>(chunks.size() / 2); }
  int n_supers() const { return static_cast<int>(supers.size() / 2); }
  int n_seqs() const { return static_cast<int>(seqs.size() / 4); }
};

// Position of sequence s's last row in its sequence (SsmParams::context_lens; empty: the row count alone).
int32_t last_position(const ops::SsmParams& sp, std::span<const int32_t> cu, size_t s) {
  return (sp.context_lens.empty() ? 0 : sp.context_lens[s]) + cu[s + 1] - cu[s] - 1;
}

// The chunk grid restarts at each sequence and at each checkpoint's cut, and a superchunk starts there too, so the
// state entering that superchunk is the checkpoint's.
Plan make_plan(std::span<const int32_t> cu, std::span<const int32_t> slots, int64_t chunk, int superchunk,
               const ops::SsmParams& sp, std::span<const ops::StateCheckpoint> checkpoints) {
  Plan plan;
  auto cp = checkpoints.begin();
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] < 0 || cu[s + 1] == cu[s]) continue;
    const int first_super = plan.n_supers();
    const int32_t context = sp.context_lens.empty() ? 0 : sp.context_lens[s];
    int64_t piece = cu[s];
    int32_t entering = -1, before = 0;  // the checkpoint at `piece` and its row's position
    while (piece < cu[s + 1]) {
      const bool cut = cp != checkpoints.end() && cp->seq == static_cast<int32_t>(s);
      const int64_t piece_end = cut ? cu[s] + cp->rows : cu[s + 1];
      int in_super = superchunk;
      for (int64_t b = piece; b < piece_end; b += chunk) {
        if (in_super == superchunk) {
          plan.supers.push_back(plan.n_chunks());
          plan.supers.push_back(0);
          if (!checkpoints.empty()) {
            plan.super_checkpoints.push_back(b == piece ? entering : -1);
            plan.super_checkpoints.push_back(before);
          }
          in_super = 0;
        }
        plan.chunks.push_back(static_cast<int32_t>(b));
        plan.chunks.push_back(static_cast<int32_t>(std::min<int64_t>(b + chunk, piece_end)));
        ++plan.supers.back();
        ++in_super;
      }
      if (cut) {
        entering = cp->slot;
        before = context + cp->rows - 1;
        ++cp;
      }
      piece = piece_end;
    }
    plan.seqs.insert(plan.seqs.end(), {first_super, plan.n_supers(), slots[s], last_position(sp, cu, s)});
  }
  return plan;
}

// Superchunk length for the tensor-core path: the largest power of two <= kMaxSuperchunk that keeps at
// least three (superchunk, head) blocks per multiprocessor (the scan runs one block per multiprocessor).
// Longer superchunks write fewer intermediate states (1/M of the per-chunk traffic) but give fewer blocks; three per
// multiprocessor keeps the scan's one-block-per-SM grid full.
int pick_superchunk(std::span<const int32_t> cu, std::span<const int32_t> slots, int64_t chunk, int64_t H) {
  int64_t n_chunks = 0;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] >= 0) n_chunks += (cu[s + 1] - cu[s] + chunk - 1) / chunk;
  }
  const int64_t target = 3 * static_cast<int64_t>(sm_count());
  int m = 1;
  while (m < kMaxSuperchunk && n_chunks * H / (2 * m) >= target) m *= 2;
  return m;
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

}  // namespace

SsdRunner::SsdRunner(const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
                     const ops::SsmParams& sp, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
                     std::span<const int32_t> slots, int64_t chunk_size, cudaStream_t stream, SsdOptions options,
                     std::span<const ops::StateCheckpoint> checkpoints)
    : act_(x.dtype()),
      state_(ssm_state.dtype()),
      A_log_(sp.A_log.data()),
      D_(sp.D.data()),
      dt_bias_(sp.dt_bias.data()),
      options_(options),
      stream_(stream) {
  constexpr const char* kOp = "ops::ssd_chunk_scan";
  check_one_dtype(kOp, y, x, dt_raw, B, C);
  a_type_ = param_type(sp.A_log, kOp, "A_log");
  d_type_ = param_type(sp.D, kOp, "D");
  b_type_ = param_type(sp.dt_bias, kOp, "dt_bias");
  const int64_t T = x.dim(0), H = x.dim(1), P = x.dim(2), G = B.dim(1), N = B.dim(2);
  if (T > INT32_MAX / 2 || chunk_size > INT32_MAX / 2) {
    throw_runtime(str_cat(kOp, ": ", T, " rows or chunk_size ", chunk_size, " is too large"));
  }
  use_mma_ = !options.portable && x.dtype() != DType::kF32 && P == kSsdMmaHeadDim && N == kSsdMmaStateSize &&
             chunk_size == kSsdMmaChunk && aligned16(x) && aligned16(B) && aligned16(C) && aligned16(y);
  superchunk_ = !use_mma_                ? 1
                : options.superchunk > 0 ? options.superchunk
                                         : pick_superchunk(cu_seqlens, slots, chunk_size, H);
  const Plan plan = make_plan(cu_seqlens, slots, chunk_size, superchunk_, sp, checkpoints);
  p_.n_chunks = plan.n_chunks();
  if (empty()) return;

  std::vector<int32_t> meta;
  meta.reserve(plan.chunks.size() + plan.supers.size() + plan.seqs.size() + plan.super_checkpoints.size());
  meta.insert(meta.end(), plan.seqs.begin(), plan.seqs.end());  // int4 first: 16-byte aligned
  meta.insert(meta.end(), plan.chunks.begin(), plan.chunks.end());
  meta.insert(meta.end(), plan.supers.begin(), plan.supers.end());
  meta.insert(meta.end(), plan.super_checkpoints.begin(), plan.super_checkpoints.end());
  const auto* dmeta =
      static_cast<const int32_t*>(upload_scratch(meta.data(), meta.size() * sizeof(int32_t), stream, 0));

  Workspace ws;
  const size_t w_params = ws.reserve(3 * static_cast<size_t>(H));
  const size_t w_dt = ws.reserve(static_cast<size_t>(H * T));
  const size_t w_acs = ws.reserve(static_cast<size_t>(H * T));
  const size_t w_states = ws.reserve(static_cast<size_t>(plan.n_supers()) * static_cast<size_t>(H * P * N));
  const size_t w_entering = ws.reserve(static_cast<size_t>(plan.n_supers()) * static_cast<size_t>(H * P * N));
  const size_t w_decay = ws.reserve(static_cast<size_t>(plan.n_supers()) * static_cast<size_t>(H));
  workspace_ = ws.allocate();

  p_.x = x.data();
  p_.dt_raw = dt_raw.data();
  p_.B = B.data();
  p_.C = C.data();
  p_.y = y.data();
  p_.ssm_state = ssm_state.data();
  prepared_ = ws.at(w_params);
  p_.A = ws.at(w_params);
  p_.D = ws.at(w_params) + H;
  p_.dt_bias = ws.at(w_params) + 2 * H;
  p_.dt_min = sp.dt_min;
  p_.dt_max = sp.dt_max;
  p_.state_seed = sp.state_seed;
  p_.T = static_cast<int>(T);
  p_.H = static_cast<int>(H);
  p_.P = static_cast<int>(P);
  p_.G = static_cast<int>(G);
  p_.N = static_cast<int>(N);
  p_.heads_per_group = static_cast<int>(H / G);
  p_.chunk_size = static_cast<int>(chunk_size);
  p_.seqs = reinterpret_cast<const int4*>(dmeta);
  p_.chunks = reinterpret_cast<const int2*>(dmeta + plan.seqs.size());
  p_.supers = reinterpret_cast<const int2*>(dmeta + plan.seqs.size() + plan.chunks.size());
  if (!plan.super_checkpoints.empty()) {
    p_.super_checkpoints =
        reinterpret_cast<const int2*>(dmeta + plan.seqs.size() + plan.chunks.size() + plan.supers.size());
  }
  p_.n_supers = plan.n_supers();
  p_.n_seqs = plan.n_seqs();
  p_.dt = ws.at(w_dt);
  p_.dA_cumsum = ws.at(w_acs);
  p_.states = ws.at(w_states);
  p_.entering = ws.at(w_entering);
  p_.decay = ws.at(w_decay);
}

void SsdRunner::prepare() const {
  launch_ssd_prepare(A_log_, a_type_, D_, d_type_, dt_bias_, b_type_, prepared_, p_.H, stream_);
}

void SsdRunner::chunk_cumsum() const {
  CHIMERA_DISPATCH_FLOAT(act_, "ops::ssd_chunk_scan x", T, { launch_ssd_chunk_cumsum<T>(p_, stream_); });
}

void SsdRunner::chunk_state() const {
  CHIMERA_DISPATCH_FLOAT(act_, "ops::ssd_chunk_scan x", T, {
    if constexpr (std::is_same_v<T, float>) {
      launch_ssd_chunk_state_portable<T>(p_, stream_);
    } else if (use_mma_) {
      launch_ssd_chunk_state_mma<T>(p_, stream_);
    } else {
      launch_ssd_chunk_state_portable<T>(p_, stream_);
    }
  });
}

void SsdRunner::state_passing() const {
  CHIMERA_DISPATCH_FLOAT(state_, "ops::ssd_chunk_scan ssm_state", S, { launch_ssd_state_passing<S>(p_, stream_); });
}

void SsdRunner::chunk_scan() const {
  CHIMERA_DISPATCH_FLOAT(act_, "ops::ssd_chunk_scan x", T, {
    if constexpr (std::is_same_v<T, float>) {
      launch_ssd_chunk_scan_portable<T>(p_, stream_);
    } else if (use_mma_) {
      launch_ssd_chunk_scan_split_mma<T>(p_, stream_);
    } else {
      launch_ssd_chunk_scan_portable<T>(p_, stream_);
    }
  });
}

void SsdRunner::run() const {
  if (empty()) return;
  prepare();
  chunk_cumsum();
  chunk_state();
  state_passing();
  chunk_scan();
}

void ssd_chunk_scan(const ops::Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                    const Tensor& C, const ops::SsmParams& sp, const Tensor& ssm_state,
                    std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots, int64_t chunk_size,
                    std::span<const ops::StateCheckpoint> checkpoints) {
  SsdRunner(y, x, dt_raw, B, C, sp, ssm_state, cu_seqlens, slots, chunk_size, as_stream(ctx.stream), {}, checkpoints)
      .run();
}

void ssm_recurrence(const ops::Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                    const Tensor& C, const ops::SsmParams& sp, const Tensor& ssm_state,
                    std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots) {
  constexpr const char* kOp = "ops::ssm_recurrence";
  check_one_dtype(kOp, y, x, dt_raw, B, C);
  const int64_t H = x.dim(1), P = x.dim(2), G = B.dim(1), N = B.dim(2);
  std::vector<int32_t> seqs;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] >= 0 && cu_seqlens[s + 1] > cu_seqlens[s]) {
      seqs.insert(seqs.end(), {cu_seqlens[s], cu_seqlens[s + 1], slots[s], last_position(sp, cu_seqlens, s)});
    }
  }
  if (seqs.empty()) return;
  const cudaStream_t stream = as_stream(ctx.stream);
  const auto* dseqs = static_cast<const int4*>(upload_scratch(seqs.data(), seqs.size() * sizeof(int32_t), stream, 0));
  const Tensor prepared = device::empty(Device::kCuda, DType::kF32, {3 * H});
  float* pr = prepared.data_as<float>();
  launch_ssd_prepare(sp.A_log.data(), param_type(sp.A_log, kOp, "A_log"), sp.D.data(), param_type(sp.D, kOp, "D"),
                     sp.dt_bias.data(), param_type(sp.dt_bias, kOp, "dt_bias"), pr, static_cast<int>(H), stream);
  SsmRecurrenceParams p;
  p.x = x.data();
  p.dt_raw = dt_raw.data();
  p.B = B.data();
  p.C = C.data();
  p.y = y.data();
  p.ssm_state = ssm_state.data();
  p.A = pr;
  p.D = pr + H;
  p.dt_bias = pr + 2 * H;
  p.dt_min = sp.dt_min;
  p.dt_max = sp.dt_max;
  p.state_seed = sp.state_seed;
  p.H = static_cast<int>(H);
  p.P = static_cast<int>(P);
  p.G = static_cast<int>(G);
  p.N = static_cast<int>(N);
  p.heads_per_group = static_cast<int>(H / G);
  p.seqs = dseqs;
  p.n_seqs = static_cast<int>(seqs.size() / 4);
  CHIMERA_DISPATCH_FLOAT(x.dtype(), "ops::ssm_recurrence x", T, {
    CHIMERA_DISPATCH_FLOAT(ssm_state.dtype(), "ops::ssm_recurrence ssm_state", S,
                           { launch_ssm_recurrence<T, S>(p, stream); });
  });
}

}  // namespace chimera::cuda
