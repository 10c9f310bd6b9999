// Backend-neutral entry points: validate shapes, dtypes and devices once, then dispatch on ctx.device.
// Errors are ErrorKind::kRuntime (a caller bug) and name the op and the tensors, e.g.
//   "ops::linear: weight BF16[64, 32] does not match x F32[5, 31]"
// except out-of-range token ids in embedding, which are bad user input (kInvalidInput).
#include "ops/ops.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "backends/cpu/cpu_ops.h"
#include "backends/device_api.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/cuda_ops.h"
#define CHIMERA_CUDA_CALL(call) call
#else
// A build without CUDA: a CUDA context fails loudly (its tensors could not exist in the first place).
#define CHIMERA_CUDA_CALL(call) ::chimera::runtime_error("this build of chimera has no CUDA backend")
#endif
#include "core/error.h"
#include "dist/host_collectives.h"
#ifdef CHIMERA_HAVE_NCCL
#include "dist/device_group.h"
#endif
#include "runtime/profiler.h"

namespace chimera::ops {
namespace {

const char* device_name(Device d) { return d == Device::kCpu ? "CPU" : "CUDA"; }

// Validation helpers bound to one op name and context.
class Check {
 public:
  Check(const Context& ctx, const char* op) : ctx_(ctx), op_(op) {}

  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) const {
    runtime_error("ops::{}: {}", op_, fmt::format(f, std::forward<Args>(args)...));
  }

  // A defined tensor on the context's device.
  void present(const char* name, const Tensor& t) const {
    if (!t) fail("{} is undefined", name);
    if (t.device() != ctx_.device) {
      fail("{} {} is on the {} but the context is {}", name, t.describe(), device_name(t.device()),
           device_name(ctx_.device));
    }
  }
  // An activation of the given rank: F32 on the CPU reference; F32, BF16 or F16 on CUDA.
  void f32(const char* name, const Tensor& t, int rank) const {
    present(name, t);
    if (ctx_.device == Device::kCpu && t.dtype() != DType::kF32) fail("{} {} must be F32", name, t.describe());
    if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16 && t.dtype() != DType::kF16) {
      fail("{} {} must be F32, BF16 or F16", name, t.describe());
    }
    if (rank >= 0 && t.ndim() != rank) fail("{} {} must have {} dimensions", name, t.describe(), rank);
  }
  // A Mamba SSM state: F32, BF16 or F16 on every backend (the math is fp32; SsmParams says how it is rounded).
  void state(const char* name, const Tensor& t, int rank) const {
    present(name, t);
    if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16 && t.dtype() != DType::kF16) {
      fail("{} {} must be F32, BF16 or F16", name, t.describe());
    }
    if (t.ndim() != rank) fail("{} {} must have {} dimensions", name, t.describe(), rank);
  }
  void i32(const char* name, const Tensor& t, int rank) const {
    present(name, t);
    if (t.dtype() != DType::kI32 || t.ndim() != rank) fail("{} {} must be a {}-D I32 tensor", name, t.describe(), rank);
  }
  // A weight in F32, BF16 or F16 of the given rank.
  void weight(const char* name, const Tensor& t, int rank) const {
    present(name, t);
    if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16 && t.dtype() != DType::kF16) {
      fail("{} {} must be F32, BF16 or F16", name, t.describe());
    }
    if (t.ndim() != rank) fail("{} {} must have {} dimensions", name, t.describe(), rank);
  }
  // `t` must have exactly `shape`, else "<name> <t> does not match <other_name> <other>".
  void shape(const char* name, const Tensor& t, const Shape& want, const char* other_name, const Tensor& other) const {
    if (t.shape() != want) fail("{} {} does not match {} {}", name, t.describe(), other_name, other.describe());
  }
  // An activation (as f32, rank 2) of x's shape [rows, hidden]; a norm weight: 1-D, x's hidden size.
  void like(const char* name, const Tensor& t, const char* x_name, const Tensor& x) const {
    f32(name, t, 2);
    shape(name, t, x.shape(), x_name, x);
  }
  void norm_weight(const char* name, const Tensor& w, const char* x_name, const Tensor& x) const {
    weight(name, w, 1);
    shape(name, w, {x.dim(1)}, x_name, x);
  }
  void no_alias(const char* a_name, const Tensor& a, const char* b_name, const Tensor& b) const {
    const auto* pa = static_cast<const char*>(a.data());
    const auto* pb = static_cast<const char*>(b.data());
    if (pa < pb + b.nbytes() && pb < pa + a.nbytes()) fail("{} must not overlap {}", a_name, b_name);
  }
  // cu_seqlens [num_seqs + 1]: starts at 0, non-decreasing, ends at T.
  void seqlens(std::span<const int32_t> cu, size_t num_seqs, int64_t T) const {
    if (cu.size() != num_seqs + 1) fail("cu_seqlens has {} entries for {} sequences", cu.size(), num_seqs);
    if (cu[0] != 0) fail("cu_seqlens[0] = {}, expected 0", cu[0]);
    for (size_t s = 0; s < num_seqs; ++s) {
      if (cu[s + 1] < cu[s]) fail("cu_seqlens is decreasing at {} ({} -> {})", s, cu[s], cu[s + 1]);
    }
    if (cu[num_seqs] != T) fail("cu_seqlens ends at {} but the batch has {} rows", cu[num_seqs], T);
  }
  // slots: each < num_slots; non-negative slots distinct (two sequences must not share a state).
  void slots(std::span<const int32_t> slots, int64_t num_slots) const {
    std::unordered_set<int32_t> seen;
    for (size_t s = 0; s < slots.size(); ++s) {
      if (slots[s] < 0) continue;
      if (slots[s] >= num_slots)
        fail("slot {} of sequence {} is out of range for {} state slots", slots[s], s, num_slots);
      if (!seen.insert(slots[s]).second) fail("slot {} is used by more than one sequence", slots[s]);
    }
  }
  // StateCheckpoint's rules, after seqlens and slots have passed.
  void checkpoints(std::span<const StateCheckpoint> cps, std::span<const int32_t> cu, std::span<const int32_t> slots,
                   int64_t num_slots) const {
    if (cps.empty()) return;  // every prefill call without prefix caching's cuts
    std::unordered_set<int32_t> taken(slots.begin(), slots.end());
    for (size_t j = 0; j < cps.size(); ++j) {
      const StateCheckpoint& k = cps[j];
      if (k.seq < 0 || static_cast<size_t>(k.seq) >= slots.size() || slots[static_cast<size_t>(k.seq)] < 0) {
        fail("checkpoint {} names sequence {}, which is not a live sequence of the call", j, k.seq);
      }
      const int32_t n = cu[static_cast<size_t>(k.seq) + 1] - cu[static_cast<size_t>(k.seq)];
      if (k.rows <= 0 || k.rows >= n) fail("checkpoint {} after {} of sequence {}'s {} rows", j, k.rows, k.seq, n);
      if (k.slot < 0 || k.slot >= num_slots)
        fail("checkpoint {} slot {} is out of range for {} slots", j, k.slot, num_slots);
      if (!taken.insert(k.slot).second)
        fail("checkpoint {} slot {} is already a sequence's or a checkpoint's", j, k.slot);
      if (j > 0 && !(cps[j - 1].seq < k.seq || (cps[j - 1].seq == k.seq && cps[j - 1].rows < k.rows))) {
        fail("checkpoints out of order at {}", j);
      }
    }
  }

  template <typename CpuFn, typename CudaFn>
  void dispatch(CpuFn&& cpu_fn, CudaFn&& cuda_fn) const {
    // The profiler's one hook: every op runs here, so the bracket covers the backend call (not the checks).
    const ProfileScope profile(ctx_.profiler, op_, ctx_.stream);
    switch (ctx_.device) {
      case Device::kCpu:
        cpu_fn();
        return;
      case Device::kCuda: {
        // The kernels this op launches take their launch options (PDL) from this context's configuration.
        const device::LaunchScope launch_scope(ctx_.kernels.pdl);
        cuda_fn();
        return;
      }
    }
    runtime_error("ops::{}: unknown device", op_);
  }

 private:
  const Context& ctx_;
  const char* op_;
};

// SsmParams::context_lens: empty, or one non-negative count per sequence of the call.
void check_context_lens(const Check& c, const SsmParams& p, size_t num_seqs) {
  if (p.context_lens.empty()) return;
  if (p.context_lens.size() != num_seqs) c.fail("{} context_lens for {} sequences", p.context_lens.size(), num_seqs);
  for (size_t s = 0; s < num_seqs; ++s) {
    if (p.context_lens[s] < 0) c.fail("context_lens[{}] = {} is negative", s, p.context_lens[s]);
  }
}

void check_ssm_params(const Check& c, const SsmParams& p, int64_t H, const Tensor& x) {
  c.weight("A_log", p.A_log, 1);
  c.weight("D", p.D, 1);
  c.weight("dt_bias", p.dt_bias, 1);
  c.shape("A_log", p.A_log, {H}, "x", x);
  c.shape("D", p.D, {H}, "x", x);
  c.shape("dt_bias", p.dt_bias, {H}, "x", x);
  if (!(p.dt_min <= p.dt_max)) c.fail("dt limits [{}, {}] are empty", p.dt_min, p.dt_max);
}

// Shared by the scan, the recurrence and the decode update: x [T, H, P], dt_raw [T, H], B, C [T, G, N],
// y [T, H, P], ssm_state [slots, H, P, N].
void check_ssm(const Check& c, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
               const SsmParams& p, const Tensor& ssm_state) {
  c.f32("x", x, 3);
  c.f32("y", y, 3);
  c.f32("dt_raw", dt_raw, 2);
  c.f32("B", B, 3);
  c.f32("C", C, 3);
  c.state("ssm_state", ssm_state, 4);
  const int64_t T = x.dim(0), H = x.dim(1), P = x.dim(2), G = B.dim(1), N = B.dim(2);
  c.shape("y", y, x.shape(), "x", x);
  c.shape("dt_raw", dt_raw, {T, H}, "x", x);
  c.shape("B", B, {T, G, N}, "x", x);
  c.shape("C", C, B.shape(), "B", B);
  if (G <= 0 || H % G != 0)
    c.fail("B {} has {} groups, which do not divide the {} heads of x {}", B.describe(), G, H, x.describe());
  c.shape("ssm_state", ssm_state, {ssm_state.dim(0), H, P, N}, "x", x);
  c.no_alias("y", y, "ssm_state", ssm_state);
  check_ssm_params(c, p, H, x);
}

void check_conv(const Check& c, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                const Tensor& conv_state) {
  c.f32("x", x, 2);
  c.f32("out", out, 2);
  c.shape("out", out, x.shape(), "x", x);
  c.present("weight", weight);
  c.weight("weight", weight, weight.ndim() == 3 ? 3 : 2);
  const int64_t C = x.dim(1);
  const int64_t K = weight.dim(-1);
  if (weight.dim(0) != C || (weight.ndim() == 3 && weight.dim(1) != 1) || K < 1) {
    c.fail("weight {} does not match x {} (expected [{}, K] or [{}, 1, K])", weight.describe(), x.describe(), C, C);
  }
  if (bias) {
    c.weight("bias", bias, 1);
    c.shape("bias", bias, {C}, "x", x);
  }
  c.f32("conv_state", conv_state, 3);
  c.shape("conv_state", conv_state, {conv_state.dim(0), C, K - 1}, "weight", weight);
  c.no_alias("out", out, "conv_state", conv_state);
}

}  // namespace

// ---- embedding, norms ------------------------------------------------------------------------------

namespace {
// embedding / embedding_shard: the table and out, and every token id in [0, vocab_size) (bad user input otherwise).
void check_embedding(const Check& c, const Tensor& out, const Tensor& table, const Indices& ids, int64_t vocab_size) {
  c.weight("table", table, 2);
  c.f32("out", out, 2);
  c.shape("out", out, {static_cast<int64_t>(ids.size()), table.dim(1)}, "table", table);
  for (size_t t = 0; t < ids.size(); ++t) {
    if (ids[t] < 0 || ids[t] >= vocab_size) {
      invalid_input("ops::embedding: token id {} at position {} is out of range for vocab size {}", ids[t], t,
                    vocab_size);
    }
  }
}
}  // namespace

void embedding(const Context& ctx, const Tensor& out, const Tensor& table, const Indices& ids) {
  const Check c(ctx, "embedding");
  check_embedding(c, out, table, ids, table.dim(0));
  c.dispatch([&] { cpu::embedding(out, table, ids.host); },
             [&] { CHIMERA_CUDA_CALL(cuda::embedding(ctx, out, table, ids)); });
}

void embedding_shard(const Context& ctx, const Tensor& out, const Tensor& table, const Indices& ids, int64_t first,
                     int64_t vocab_size) {
  const Check c(ctx, "embedding_shard");
  check_embedding(c, out, table, ids, vocab_size);
  const int64_t V = table.dim(0);
  if (first < 0 || first + V > vocab_size) c.fail("rows [{}, {}) of a vocabulary of {}", first, first + V, vocab_size);
  c.dispatch([&] { cpu::embedding_shard(out, table, ids.host, first); },
             [&] { CHIMERA_CUDA_CALL(cuda::embedding(ctx, out, table, ids, first, /*shard=*/true)); });
}

void convert(const Context& ctx, const Tensor& out, const Tensor& in) {
  const Check c(ctx, "convert");
  c.f32("in", in, 2);
  c.like("out", out, "in", in);
  c.no_alias("out", out, "in", in);
  c.dispatch([&] { cpu::convert(out, in); }, [&] { CHIMERA_CUDA_CALL(cuda::convert(ctx, out, in)); });
}

void rms_norm(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, float eps) {
  const Check c(ctx, "rms_norm");
  c.f32("x", x, 2);
  c.like("out", out, "x", x);
  c.norm_weight("weight", weight, "x", x);
  c.dispatch([&] { cpu::rms_norm(out, x, weight, eps); }, [&] { CHIMERA_CUDA_CALL(cuda::rms_norm(ctx, out, x, weight, eps)); });
}

void add_rms_norm(const Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& x, const Tensor& weight,
                  float eps) {
  const Check c(ctx, "add_rms_norm");
  c.f32("x", x, 2);
  c.like("residual", residual, "x", x);
  c.like("out", out, "x", x);
  c.norm_weight("weight", weight, "x", x);
  c.dispatch([&] { cpu::add_rms_norm(residual, out, x, weight, eps); }, [&] { CHIMERA_CUDA_CALL(cuda::add_rms_norm(ctx, residual, out, x, weight, eps)); });
}

void add2_rms_norm(const Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& a, const Tensor& b,
                   const Tensor& weight, float eps) {
  const Check c(ctx, "add2_rms_norm");
  c.f32("a", a, 2);
  c.like("b", b, "a", a);
  c.like("residual", residual, "a", a);
  c.like("out", out, "a", a);
  c.norm_weight("weight", weight, "a", a);
  c.dispatch([&] { cpu::add2_rms_norm(residual, out, a, b, weight, eps); },
             [&] { CHIMERA_CUDA_CALL(cuda::add2_rms_norm(ctx, residual, out, a, b, weight, eps)); });
}

void gated_rms_norm(const Context& ctx, const Tensor& out, const Tensor& y, const Tensor& z, const Tensor& weight,
                    int64_t n_groups, float eps, const SpannedNorm* spanned) {
  const Check c(ctx, "gated_rms_norm");
  c.f32("y", y, 2);
  c.like("z", z, "y", y);
  c.like("out", out, "y", y);
  c.norm_weight("weight", weight, "y", y);
  if (n_groups <= 0 || y.dim(1) % n_groups != 0) c.fail("n_groups {} does not divide y {}", n_groups, y.describe());
  if (spanned) {
    const SpannedNorm& sn = *spanned;
    if (n_groups != 1 || sn.span < 1 || sn.group < 0 || sn.group >= sn.n_groups || !sn.tp.group) {
      c.fail("a spanned norm needs n_groups 1 (got {}), a group in [0, {}) (got {}) and a communicator", n_groups,
             sn.n_groups, sn.group);
    }
    // The CPU's two halves on host tensors: each rank's sum of squares in its group's column, zeros elsewhere, so
    // one host all_reduce sums every group's parts; then the norm.
    const auto on_host = [&](const Tensor& o, const Tensor& hy, const Tensor& hz, const Tensor& hw) {
      const Tensor sums = Tensor::empty(DType::kF32, {y.dim(0), sn.n_groups});
      device::zero(sums);
      cpu::gated_square_sums(sums, hy, hz, sn.group);
      sn.tp.group->all_reduce_sum(sn.tp.rank, {sums.f32(), static_cast<size_t>(sums.numel())});
      cpu::gated_rms_norm_from_sums(o, hy, hz, hw, sums, sn.group, y.dim(1) * sn.span, eps);
    };
    c.dispatch([&] { on_host(out, y, z, weight); },
               [&] {
                 // Ranks outnumber the model's groups: on host copies (no Nemotron-H model spans a group below 16
                 // ranks, so this path is for the tests' small fixtures).
                 const Tensor hout = Tensor::empty(DType::kF32, out.shape());
                 on_host(hout, device::to_host_f32(y), device::to_host_f32(z), device::to_host_f32(weight));
                 device::copy(out, device::to_device(hout, Device::kCuda, out.dtype()));
               });
    return;
  }
  c.dispatch([&] { cpu::gated_rms_norm(out, y, z, weight, n_groups, eps); }, [&] { CHIMERA_CUDA_CALL(cuda::gated_rms_norm(ctx, out, y, z, weight, n_groups, eps)); });
}

// ---- dense -----------------------------------------------------------------------------------------

void linear(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const Check c(ctx, "linear");
  c.f32("x", x, 2);
  c.weight("weight", weight, 2);
  c.shape("weight", weight, {weight.dim(0), x.dim(1)}, "x", x);
  c.f32("out", out, 2);
  c.shape("out", out, {x.dim(0), weight.dim(0)}, "x @ weight^T with weight", weight);
  if (bias) {
    c.weight("bias", bias, 1);
    c.shape("bias", bias, {weight.dim(0)}, "weight", weight);
  }
  c.no_alias("out", out, "x", x);
  c.dispatch([&] { cpu::linear(out, x, weight, bias); }, [&] { CHIMERA_CUDA_CALL(cuda::linear(ctx, out, x, weight, bias)); });
}

void linear_multi(const Context& ctx, std::span<const Tensor> outs, const Tensor& x, std::span<const Tensor> weights) {
  const Check c(ctx, "linear_multi");
  if (outs.size() != weights.size() || weights.empty() || weights.size() > 3) {
    c.fail("{} outputs for {} weights (1 to 3 of each, one output per weight)", outs.size(), weights.size());
  }
  c.f32("x", x, 2);
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::string w = fmt::format("weights[{}]", i), o = fmt::format("outs[{}]", i);
    c.weight(w.c_str(), weights[i], 2);
    c.shape(w.c_str(), weights[i], {weights[i].dim(0), x.dim(1)}, "x", x);
    c.f32(o.c_str(), outs[i], 2);
    c.shape(o.c_str(), outs[i], {x.dim(0), weights[i].dim(0)}, "x @ weight^T with weight", weights[i]);
    c.no_alias(o.c_str(), outs[i], "x", x);
  }
  c.dispatch(
      [&] {
        for (size_t i = 0; i < weights.size(); ++i) cpu::linear(outs[i], x, weights[i], Tensor());
      },
      [&] { CHIMERA_CUDA_CALL(cuda::linear_multi(ctx, outs, x, weights)); });
}

namespace {
// The residual step's tensors (ResidualNorm), as residual_norm_linear and residual_rms_norm both take them.
void check_residual_step(const Check& c, const ResidualNorm& rn) {
  c.f32("a", rn.a, 2);
  if (rn.b) c.like("b", rn.b, "a", rn.a);
  c.like("residual", rn.residual, "a", rn.a);
  c.like("residual_out", rn.residual_out, "a", rn.a);
  c.like("x", rn.x, "a", rn.a);
  c.norm_weight("norm_weight", rn.norm_weight, "a", rn.a);
  c.no_alias("residual_out", rn.residual_out, "residual", rn.residual);
  c.no_alias("residual_out", rn.residual_out, "a", rn.a);
  if (rn.b) c.no_alias("residual_out", rn.residual_out, "b", rn.b);
}
// The CPU reference of the residual step: the out-of-place copy, then the in-place norm op.
void cpu_residual_step(const ResidualNorm& rn) {
  cpu::convert(rn.residual_out, rn.residual);
  if (rn.b) {
    cpu::add2_rms_norm(rn.residual_out, rn.x, rn.a, rn.b, rn.norm_weight, rn.eps);
  } else {
    cpu::add_rms_norm(rn.residual_out, rn.x, rn.a, rn.norm_weight, rn.eps);
  }
}
}  // namespace

void residual_norm_linear(const Context& ctx, const ResidualNorm& rn, std::span<const Tensor> outs,
                          std::span<const Tensor> weights, const Tensor& bias) {
  const Check c(ctx, "residual_norm_linear");
  if (outs.size() != weights.size() || weights.empty() || weights.size() > 3) {
    c.fail("{} outputs for {} weights (1 to 3 of each, one output per weight)", outs.size(), weights.size());
  }
  check_residual_step(c, rn);
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::string w = fmt::format("weights[{}]", i), o = fmt::format("outs[{}]", i);
    c.weight(w.c_str(), weights[i], 2);
    c.shape(w.c_str(), weights[i], {weights[i].dim(0), rn.a.dim(1)}, "a", rn.a);
    c.f32(o.c_str(), outs[i], 2);
    c.shape(o.c_str(), outs[i], {rn.a.dim(0), weights[i].dim(0)}, "x @ weight^T with weight", weights[i]);
    c.no_alias(o.c_str(), outs[i], "x", rn.x);
    c.no_alias(o.c_str(), outs[i], "residual_out", rn.residual_out);
  }
  if (bias) {
    if (weights.size() != 1) c.fail("a bias needs exactly one weight ({} given)", weights.size());
    c.weight("bias", bias, 1);
    c.shape("bias", bias, {weights[0].dim(0)}, "weights[0]", weights[0]);
  }
  c.dispatch(
      [&] {
        cpu_residual_step(rn);
        for (size_t i = 0; i < weights.size(); ++i) cpu::linear(outs[i], rn.x, weights[i], bias);
      },
      [&] { CHIMERA_CUDA_CALL(cuda::residual_norm_linear(ctx, rn, outs, weights, bias)); });
}

void residual_rms_norm(const Context& ctx, const ResidualNorm& rn) {
  const Check c(ctx, "residual_rms_norm");
  check_residual_step(c, rn);
  c.dispatch([&] { cpu_residual_step(rn); }, [&] { CHIMERA_CUDA_CALL(cuda::residual_rms_norm(ctx, rn)); });
}

void relu2(const Context& ctx, const Tensor& x) {
  const Check c(ctx, "relu2");
  c.f32("x", x, -1);
  c.dispatch([&] { cpu::relu2(x); }, [&] { CHIMERA_CUDA_CALL(cuda::relu2(ctx, x)); });
}

namespace {
void check_relu2_mlp(const Check& c, const Tensor& out, const Tensor& x, const Tensor& up_proj,
                     const Tensor& down_proj) {
  c.f32("x", x, 2);
  c.like("out", out, "x", x);
  c.weight("up_proj", up_proj, 2);
  c.shape("up_proj", up_proj, {up_proj.dim(0), x.dim(1)}, "x", x);
  c.weight("down_proj", down_proj, 2);
  c.shape("down_proj", down_proj, {x.dim(1), up_proj.dim(0)}, "up_proj", up_proj);
}
}  // namespace

void relu2_mlp(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& up_proj, const Tensor& down_proj) {
  const Check c(ctx, "relu2_mlp");
  check_relu2_mlp(c, out, x, up_proj, down_proj);
  c.dispatch([&] { cpu::relu2_mlp(out, x, up_proj, down_proj); }, [&] { CHIMERA_CUDA_CALL(cuda::relu2_mlp(ctx, out, x, up_proj, down_proj)); });
}

// ---- Mamba-2 ---------------------------------------------------------------------------------------

void causal_conv1d(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                   const Tensor& conv_state, std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots,
                   bool silu, std::span<const StateCheckpoint> checkpoints) {
  const Check c(ctx, "causal_conv1d");
  check_conv(c, out, x, weight, bias, conv_state);
  c.seqlens(cu_seqlens, slots.size(), x.dim(0));
  c.slots(slots, conv_state.dim(0));
  c.checkpoints(checkpoints, cu_seqlens, slots, conv_state.dim(0));
  c.dispatch([&] { cpu::causal_conv1d(out, x, weight, bias, conv_state, cu_seqlens, slots, silu, checkpoints); },
             [&] {
               CHIMERA_CUDA_CALL(
                   cuda::causal_conv1d(ctx, out, x, weight, bias, conv_state, cu_seqlens, slots, silu, checkpoints));
             });
}

namespace {
// Out of place: a live row's destination is in range and no other live row's source or destination (a kernel may
// still be reading one sequence's source while it writes another's destination). Empty dst_slots: in place.
void check_dst_slots(const Check& c, const Indices& slots, const Indices& dst_slots, int64_t num_slots) {
  if (dst_slots.empty()) return;
  if (dst_slots.size() != slots.size()) c.fail("{} dst_slots for {} slots", dst_slots.size(), slots.size());
  std::unordered_map<int32_t, size_t> src_of;  // source slot -> its sequence
  for (size_t b = 0; b < slots.size(); ++b) {
    if (slots[b] >= 0) src_of.emplace(slots[b], b);
  }
  std::unordered_set<int32_t> dst_seen;
  for (size_t b = 0; b < slots.size(); ++b) {
    if (slots[b] < 0) continue;
    const int32_t d = dst_slots[b];
    if (d < 0 || d >= num_slots)
      c.fail("dst slot {} of sequence {} is out of range for {} state slots", d, b, num_slots);
    if (!dst_seen.insert(d).second) c.fail("dst slot {} is the destination of more than one sequence", d);
    const auto it = src_of.find(d);
    if (it != src_of.end() && it->second != b) {
      c.fail("dst slot {} of sequence {} is the source slot of sequence {}", d, b, it->second);
    }
  }
}
}  // namespace

void causal_conv1d_update(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                          const Tensor& bias, const Tensor& conv_state, const Indices& slots, bool silu,
                          const Indices& dst_slots) {
  const Check c(ctx, "causal_conv1d_update");
  check_conv(c, out, x, weight, bias, conv_state);
  if (static_cast<int64_t>(slots.size()) != x.dim(0)) c.fail("{} slots for x {}", slots.size(), x.describe());
  c.slots(slots.host, conv_state.dim(0));
  check_dst_slots(c, slots, dst_slots, conv_state.dim(0));
  c.dispatch(
      [&] { cpu::causal_conv1d_update(out, x, weight, bias, conv_state, slots.host, silu, dst_slots.host); },
      [&] {
        CHIMERA_CUDA_CALL(cuda::causal_conv1d_update(ctx, out, x, weight, bias, conv_state, slots, silu, dst_slots));
      });
}

void ssd_chunk_scan(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                    const Tensor& C, const SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
                    std::span<const int32_t> slots, int64_t chunk_size, std::span<const StateCheckpoint> checkpoints) {
  const Check c(ctx, "ssd_chunk_scan");
  check_ssm(c, y, x, dt_raw, B, C, p, ssm_state);
  if (chunk_size <= 0) c.fail("chunk_size {} must be positive", chunk_size);
  c.seqlens(cu_seqlens, slots.size(), x.dim(0));
  c.slots(slots, ssm_state.dim(0));
  c.checkpoints(checkpoints, cu_seqlens, slots, ssm_state.dim(0));
  check_context_lens(c, p, slots.size());
  c.dispatch([&] { cpu::ssd_chunk_scan(y, x, dt_raw, B, C, p, ssm_state, cu_seqlens, slots, chunk_size, checkpoints); },
             [&] {
               CHIMERA_CUDA_CALL(cuda::ssd_chunk_scan(ctx, y, x, dt_raw, B, C, p, ssm_state, cu_seqlens, slots,
                                                      chunk_size, checkpoints));
             });
}

void ssm_recurrence(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                    const Tensor& C, const SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
                    std::span<const int32_t> slots) {
  const Check c(ctx, "ssm_recurrence");
  check_ssm(c, y, x, dt_raw, B, C, p, ssm_state);
  c.seqlens(cu_seqlens, slots.size(), x.dim(0));
  c.slots(slots, ssm_state.dim(0));
  check_context_lens(c, p, slots.size());
  c.dispatch([&] { cpu::ssm_recurrence(y, x, dt_raw, B, C, p, ssm_state, cu_seqlens, slots); }, [&] { CHIMERA_CUDA_CALL(cuda::ssm_recurrence(ctx, y, x, dt_raw, B, C, p, ssm_state, cu_seqlens, slots)); });
}

void selective_state_update(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                            const Tensor& C, const SsmParams& p, const Tensor& ssm_state, const Indices& slots) {
  selective_state_update(ctx, y, x, dt_raw, B, C, p, ssm_state, slots, Indices{});
}

void selective_state_update(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                            const Tensor& C, const SsmParams& p, const Tensor& ssm_state, const Indices& slots,
                            const Indices& dst_slots) {
  const Check c(ctx, "selective_state_update");
  check_ssm(c, y, x, dt_raw, B, C, p, ssm_state);
  if (static_cast<int64_t>(slots.size()) != x.dim(0)) c.fail("{} slots for x {}", slots.size(), x.describe());
  c.slots(slots.host, ssm_state.dim(0));
  check_context_lens(c, p, slots.size());
  check_dst_slots(c, slots, dst_slots, ssm_state.dim(0));
  c.dispatch([&] { cpu::selective_state_update(y, x, dt_raw, B, C, p, ssm_state, slots.host, dst_slots.host); }, [&] { CHIMERA_CUDA_CALL(cuda::selective_state_update(ctx, y, x, dt_raw, B, C, p, ssm_state, slots, dst_slots)); });
}

namespace {

// mamba_decode_update as its three ops (the CPU reference; on CUDA the path for sizes the fused kernel does not
// take). The column splits are copies, so every value is the one the model's unfused path computes. On the CPU the
// norm runs per non-pad row so pad rows of out stay untouched; on CUDA the slots may live on the device only (a
// captured graph), so the norm covers every row and pad rows get unspecified values.
void mamba_decode_compose(const Context& ctx, const Tensor& out, const Tensor& zxbcdt, const Tensor& conv_weight,
                          const Tensor& conv_bias, const SsmParams& p, const Tensor& norm_weight, int64_t G, float eps,
                          const Tensor& conv_state, const Tensor& ssm_state, const Indices& slots,
                          const Indices& dst_slots, const SpannedNorm* spanned) {
  const int64_t Bn = zxbcdt.dim(0), H = ssm_state.dim(1), P = ssm_state.dim(2), N = ssm_state.dim(3);
  const int64_t Di = H * P, Cd = Di + 2 * G * N;
  const auto tmp = [&](Shape shape) { return device::empty(ctx.device, zxbcdt.dtype(), std::move(shape)); };
  const Tensor z = tmp({Bn, Di}), xbc = tmp({Bn, Cd}), dt = tmp({Bn, H});
  copy_columns(ctx, z, zxbcdt, 0);
  copy_columns(ctx, xbc, zxbcdt, Di);
  copy_columns(ctx, dt, zxbcdt, Di + Cd);
  const Tensor xbc_act = tmp({Bn, Cd});
  causal_conv1d_update(ctx, xbc_act, xbc, conv_weight, conv_bias, conv_state, slots, /*silu=*/true, dst_slots);
  const Tensor x = tmp({Bn, Di}), B = tmp({Bn, G * N}), C = tmp({Bn, G * N});
  copy_columns(ctx, x, xbc_act, 0);
  copy_columns(ctx, B, xbc_act, Di);
  copy_columns(ctx, C, xbc_act, Di + G * N);
  const Tensor y = tmp({Bn, H, P});
  selective_state_update(ctx, y, x.reshape({Bn, H, P}), dt, B.reshape({Bn, G, N}), C.reshape({Bn, G, N}), p, ssm_state,
                         slots, dst_slots);
  const Tensor y2 = y.reshape({Bn, Di});
  if (spanned) {
    // Every row at once: the sums are exchanged once for the whole batch (a pad row's values are unspecified).
    gated_rms_norm(ctx, out, y2, z, norm_weight, G, eps, spanned);
  } else if (ctx.device == Device::kCpu) {
    for (int64_t b = 0; b < Bn; ++b) {
      if (slots[static_cast<size_t>(b)] < 0) continue;
      gated_rms_norm(ctx, out.rows(b, b + 1), y2.rows(b, b + 1), z.rows(b, b + 1), norm_weight, G, eps);
    }
  } else {
    gated_rms_norm(ctx, out, y2, z, norm_weight, G, eps);
  }
}

}  // namespace

void mamba_decode_update(const Context& ctx, const Tensor& out, const Tensor& zxbcdt, const Tensor& conv_weight,
                         const Tensor& conv_bias, const SsmParams& p, const Tensor& norm_weight, int64_t n_groups,
                         float eps, const Tensor& conv_state, const Tensor& ssm_state, const Indices& slots,
                         [[maybe_unused]] bool prefetch_states,  // unused without CUDA
                         const Indices& dst_slots, const SpannedNorm* spanned) {
  const Check c(ctx, "mamba_decode_update");
  c.f32("zxbcdt", zxbcdt, 2);
  c.f32("out", out, 2);
  c.state("ssm_state", ssm_state, 4);
  c.f32("conv_state", conv_state, 3);
  const int64_t Bn = zxbcdt.dim(0), H = ssm_state.dim(1), P = ssm_state.dim(2), N = ssm_state.dim(3);
  if (n_groups <= 0 || H % n_groups != 0)
    c.fail("n_groups {} does not divide the {} heads of ssm_state {}", n_groups, H, ssm_state.describe());
  const int64_t Di = H * P, Cd = Di + 2 * n_groups * N;
  c.shape("zxbcdt", zxbcdt, {Bn, Di + Cd + H}, "ssm_state", ssm_state);
  c.shape("out", out, {Bn, Di}, "zxbcdt", zxbcdt);
  c.weight("conv_weight", conv_weight, conv_weight.ndim() == 3 ? 3 : 2);
  const int64_t K = conv_weight.dim(-1);
  if (conv_weight.dim(0) != Cd || (conv_weight.ndim() == 3 && conv_weight.dim(1) != 1) || K < 1) {
    c.fail("conv_weight {} does not match ssm_state {} (expected [{}, K] or [{}, 1, K])", conv_weight.describe(),
           ssm_state.describe(), Cd, Cd);
  }
  if (conv_bias) {
    c.weight("conv_bias", conv_bias, 1);
    c.shape("conv_bias", conv_bias, {Cd}, "conv_weight", conv_weight);
  }
  c.shape("conv_state", conv_state, {conv_state.dim(0), Cd, K - 1}, "conv_weight", conv_weight);
  check_ssm_params(c, p, H, ssm_state);
  c.weight("norm_weight", norm_weight, 1);
  c.shape("norm_weight", norm_weight, {Di}, "ssm_state", ssm_state);
  c.no_alias("out", out, "zxbcdt", zxbcdt);
  c.no_alias("out", out, "conv_state", conv_state);
  c.no_alias("out", out, "ssm_state", ssm_state);
  if (static_cast<int64_t>(slots.size()) != Bn) c.fail("{} slots for zxbcdt {}", slots.size(), zxbcdt.describe());
  c.slots(slots.host, std::min(conv_state.dim(0), ssm_state.dim(0)));
  check_context_lens(c, p, slots.size());
  check_dst_slots(c, slots, dst_slots, std::min(conv_state.dim(0), ssm_state.dim(0)));
#ifdef CHIMERA_HAVE_CUDA
  // The backend's plan: the fused kernel up to mamba_decode_fused_max_rows rows (beyond that the separate kernels
  // fill the GPU better), where it takes the sizes; out of place always the three ops.
  const bool fused = ctx.device == Device::kCuda && dst_slots.empty() && spanned == nullptr &&
                     Bn <= ctx.kernels.mamba_decode_fused_max_rows &&
                     cuda::mamba_decode_fusable(zxbcdt, conv_weight, conv_state, ssm_state, n_groups);
#else
  const bool fused = false;
#endif
  if (!fused) {  // the CPU reference, and CUDA sizes the fused kernel does not take: each op dispatches itself
    mamba_decode_compose(ctx, out, zxbcdt, conv_weight, conv_bias, p, norm_weight, n_groups, eps, conv_state, ssm_state,
                         slots, dst_slots, spanned);
    return;
  }
  c.dispatch([&] { runtime_error("ops::mamba_decode_update: the CPU backend composes the three ops"); },
             [&] {
               CHIMERA_CUDA_CALL(cuda::mamba_decode_update(ctx, out, zxbcdt, conv_weight, conv_bias, p, norm_weight,
                                                           n_groups, eps, conv_state, ssm_state, slots,
                                                           prefetch_states));
             });
}

// ---- attention -------------------------------------------------------------------------------------

void attention(const Context& ctx, const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
               const KvCacheView& cache, const Indices& cu_seqlens, const Indices& context_lens,
               const Tensor& block_tables, float scale) {
  const Check c(ctx, "attention");
  c.f32("q", q, 3);
  c.f32("k", k, 3);
  c.f32("v", v, 3);
  c.f32("out", out, 3);
  const int64_t T = q.dim(0), Qh = q.dim(1), hd = q.dim(2), KVh = k.dim(1);
  c.shape("out", out, q.shape(), "q", q);
  c.shape("k", k, {T, KVh, hd}, "q", q);
  c.shape("v", v, k.shape(), "k", k);
  if (KVh <= 0 || Qh % KVh != 0)
    c.fail("k {} has {} heads, which do not divide the {} heads of q {}", k.describe(), KVh, Qh, q.describe());
  if (cache.k && cache.k.dtype() == DType::kF8E4M3) {  // an FP8 cache: both tensors, finite positive scales
    c.present("cache.k", cache.k);
    c.present("cache.v", cache.v);
    if (cache.v.dtype() != DType::kF8E4M3 || cache.k.ndim() != 4 || cache.v.ndim() != 4) {
      c.fail("cache.k {} and cache.v {} must both be 4-D F8_E4M3", cache.k.describe(), cache.v.describe());
    }
    for (const float s : {cache.k_scale, cache.v_scale}) {
      if (!(s > 0.0f) || !std::isfinite(s)) c.fail("FP8 KV cache scales {} / {} must be finite and > 0", cache.k_scale, cache.v_scale);
    }
  } else {
    c.f32("cache.k", cache.k, 4);
    c.f32("cache.v", cache.v, 4);
  }
  const int64_t num_blocks = cache.k.dim(0), block_size = cache.k.dim(1);
  c.shape("cache.k", cache.k, {num_blocks, block_size, KVh, hd}, "k", k);
  c.shape("cache.v", cache.v, cache.k.shape(), "cache.k", cache.k);
  c.no_alias("out", out, "cache.k", cache.k);
  c.no_alias("out", out, "cache.v", cache.v);
  const size_t S = context_lens.size();
  c.seqlens(cu_seqlens.host, S, T);
  c.i32("block_tables", block_tables, 2);
  if (block_tables.dim(0) != static_cast<int64_t>(S)) {
    c.fail("block_tables {} has a row count other than the {} sequences", block_tables.describe(), S);
  }
  const int64_t max_blocks = block_tables.dim(1);
  for (size_t s = 0; s < S; ++s) {
    const int64_t end = int64_t{context_lens[s]} + cu_seqlens[s + 1] - cu_seqlens[s];
    if (context_lens[s] < 0) c.fail("context_lens[{}] = {} is negative", s, context_lens[s]);
    if (end > max_blocks * block_size) {
      c.fail("sequence {} needs {} positions but block_tables {} with block size {} holds {}", s, end,
             block_tables.describe(), block_size, max_blocks * block_size);
    }
    // Block ids are checked where they are readable: on the host (device tables are the runtime's job).
    for (int64_t b = 0; block_tables.device() == Device::kCpu && b < (end + block_size - 1) / block_size; ++b) {
      const int32_t id = block_tables.i32()[static_cast<int64_t>(s) * max_blocks + b];
      if (id < 0 || id >= num_blocks)
        c.fail("block_tables[{}, {}] = {} is out of range for {} blocks", s, b, id, num_blocks);
    }
  }
  c.dispatch([&] { cpu::attention(out, q, k, v, cache, cu_seqlens.host, context_lens.host, block_tables, scale); }, [&] { CHIMERA_CUDA_CALL(cuda::attention(ctx, out, q, k, v, cache, cu_seqlens, context_lens, block_tables, scale)); });
}

// ---- MoE -------------------------------------------------------------------------------------------

namespace {

// The routing parameters and outputs of router_topk / router_gate_topk for T tokens and E experts.
// `rows` ([T, ...]) and `experts` ([..., E] logits or [E, D] gate) name the tensors the shapes come from.
void check_router(const Check& c, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& correction_bias,
                  const RouterParams& p, int64_t T, int64_t E, const char* rows_name, const Tensor& rows,
                  const char* experts_name, const Tensor& experts) {
  c.weight("correction_bias", correction_bias, 1);
  c.shape("correction_bias", correction_bias, {E}, experts_name, experts);
  if (p.n_group < 1 || E % p.n_group != 0) c.fail("n_group {} does not divide the {} experts", p.n_group, E);
  if (p.topk_group < 1 || p.topk_group > p.n_group)
    c.fail("topk_group {} is not in [1, n_group = {}]", p.topk_group, p.n_group);
  if (p.top_k < 1 || p.top_k > p.topk_group * (E / p.n_group)) {
    c.fail("top_k {} is not in [1, {}] (topk_group {} groups of {} experts)", p.top_k, p.topk_group * (E / p.n_group),
           p.topk_group, E / p.n_group);
  }
  c.i32("topk_ids", topk_ids, 2);
  c.shape("topk_ids", topk_ids, {T, p.top_k}, rows_name, rows);
  c.f32("topk_weights", topk_weights, 2);
  c.shape("topk_weights", topk_weights, {T, p.top_k}, rows_name, rows);
}

}  // namespace

void router_topk(const Context& ctx, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& logits,
                 const Tensor& correction_bias, const RouterParams& p) {
  const Check c(ctx, "router_topk");
  c.f32("logits", logits, 2);
  const int64_t T = logits.dim(0), E = logits.dim(1);
  check_router(c, topk_ids, topk_weights, correction_bias, p, T, E, "logits", logits, "logits", logits);
  c.dispatch([&] { cpu::router_topk(topk_ids, topk_weights, logits, correction_bias, p); }, [&] { CHIMERA_CUDA_CALL(cuda::router_topk(ctx, topk_ids, topk_weights, logits, correction_bias, p)); });
}

void router_gate_topk(const Context& ctx, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& x,
                      const Tensor& gate, const Tensor& correction_bias, const RouterParams& p) {
  const Check c(ctx, "router_gate_topk");
  c.f32("x", x, 2);
  c.weight("gate", gate, 2);
  c.shape("gate", gate, {gate.dim(0), x.dim(1)}, "x", x);
  const int64_t T = x.dim(0), E = gate.dim(0);
  check_router(c, topk_ids, topk_weights, correction_bias, p, T, E, "x", x, "gate", gate);
  c.dispatch([&] { cpu::router_gate_topk(topk_ids, topk_weights, x, gate, correction_bias, p); },
             [&] { CHIMERA_CUDA_CALL(cuda::router_gate_topk(ctx, topk_ids, topk_weights, x, gate, correction_bias, p)); });
}

namespace {
void check_moe_experts(const Check& c, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                       const Tensor& topk_weights, std::span<const Tensor> up_proj,
                       std::span<const Tensor> down_proj) {
  c.f32("x", x, 2);
  c.f32("out", out, 2);
  c.shape("out", out, x.shape(), "x", x);
  c.no_alias("out", out, "x", x);
  const int64_t T = x.dim(0), Din = x.dim(1);
  c.i32("topk_ids", topk_ids, 2);
  c.shape("topk_ids", topk_ids, {T, topk_ids.dim(1)}, "x", x);
  c.f32("topk_weights", topk_weights, 2);
  c.shape("topk_weights", topk_weights, topk_ids.shape(), "topk_ids", topk_ids);
  const size_t E = up_proj.size();
  if (E == 0 || down_proj.size() != E) c.fail("{} up_proj and {} down_proj experts", up_proj.size(), down_proj.size());
  for (size_t e = 0; e < E; ++e) {
    c.weight("up_proj[e]", up_proj[e], 2);
    c.weight("down_proj[e]", down_proj[e], 2);
    if (up_proj[e].dim(1) != Din) c.fail("up_proj[{}] {} does not match x {}", e, up_proj[e].describe(), x.describe());
    if (down_proj[e].shape() != Shape{Din, up_proj[e].dim(0)}) {
      c.fail("down_proj[{}] {} does not match up_proj[{}] {}", e, down_proj[e].describe(), e, up_proj[e].describe());
    }
  }
  for (int64_t i = 0; topk_ids.device() == Device::kCpu && i < topk_ids.numel(); ++i) {
    const int32_t id = topk_ids.i32()[i];
    // -1: a pair no expert of this call runs (expert parallelism: another rank's expert).
    if (id < -1 || id >= static_cast<int64_t>(E)) c.fail("topk_ids[{}] = {} is out of range for {} experts", i, id, E);
  }
}
}  // namespace

void local_expert_ids(const Context& ctx, const Tensor& topk_ids, int64_t first, int64_t count) {
  const Check c(ctx, "local_expert_ids");
  c.i32("topk_ids", topk_ids, 2);
  if (first < 0 || count < 1) c.fail("experts [{}, {} + {})", first, first, count);
  c.dispatch([&] { cpu::local_expert_ids(topk_ids, first, count); },
             [&] { CHIMERA_CUDA_CALL(cuda::local_expert_ids(ctx, topk_ids, first, count)); });
}

void moe_experts(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                 const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj) {
  const Check c(ctx, "moe_experts");
  check_moe_experts(c, out, x, topk_ids, topk_weights, up_proj, down_proj);
  c.dispatch([&] { cpu::moe_experts(out, x, topk_ids, topk_weights, up_proj, down_proj); }, [&] { CHIMERA_CUDA_CALL(cuda::moe_experts(ctx, out, x, topk_ids, topk_weights, up_proj, down_proj)); });
}

void moe_experts_shared(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                        const Tensor& topk_weights, std::span<const Tensor> up_proj,
                        std::span<const Tensor> down_proj, const SharedExpert& shared) {
  const Check c(ctx, "moe_experts_shared");
  check_moe_experts(c, out, x, topk_ids, topk_weights, up_proj, down_proj);
  check_relu2_mlp(c, shared.out, shared.x, shared.up_proj, shared.down_proj);
  c.shape("shared.x", shared.x, {x.dim(0), shared.x.dim(1)}, "x", x);
  c.no_alias("shared.out", shared.out, "out", out);
  c.no_alias("shared.out", shared.out, "x", x);
  c.no_alias("shared.out", shared.out, "shared.x", shared.x);
  c.no_alias("out", out, "shared.x", shared.x);
  c.dispatch(
      [&] {
        cpu::moe_experts(out, x, topk_ids, topk_weights, up_proj, down_proj);
        cpu::relu2_mlp(shared.out, shared.x, shared.up_proj, shared.down_proj);
      },
      [&] {
        CHIMERA_CUDA_CALL(cuda::moe_experts_shared(ctx, out, x, topk_ids, topk_weights, up_proj, down_proj, shared));
      });
}

// ---- sampling --------------------------------------------------------------------------------------

void sample_tokens(const Context& ctx, const SamplingOutputs& out, const Tensor& logits,
                   std::span<const SamplingRow> rows, std::span<const PenaltyToken> penalty_tokens) {
  const Check c(ctx, "sample_tokens");
  c.present("logits", logits);
  if (logits.dtype() != DType::kF32 || logits.ndim() != 2) c.fail("logits {} must be a 2-D F32 tensor", logits.describe());
  const int64_t R = logits.dim(0), V = logits.dim(1);
  c.i32("out_ids", out.ids, 1);
  c.shape("out_ids", out.ids, {R}, "logits", logits);
  if (static_cast<int64_t>(rows.size()) != R) c.fail("{} sampling rows for logits {}", rows.size(), logits.describe());
  if (R > 0 && V == 0) c.fail("logits {} has an empty vocabulary", logits.describe());
  int32_t top_wanted = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const SamplingRow& p = rows[r];
    if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
      c.fail("row {}: temperature {} must be a finite number >= 0", r, p.temperature);
    if (p.top_k < 0) c.fail("row {}: top_k {} must be >= 0", r, p.top_k);
    if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) c.fail("row {}: top_p {} must be in (0, 1]", r, p.top_p);
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) c.fail("row {}: min_p {} must be in [0, 1]", r, p.min_p);
    if (!std::isfinite(p.presence_penalty) || !std::isfinite(p.frequency_penalty))
      c.fail("row {}: presence_penalty {} and frequency_penalty {} must be finite", r, p.presence_penalty,
             p.frequency_penalty);
    if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty))
      c.fail("row {}: repetition_penalty {} must be a finite number > 0", r, p.repetition_penalty);
    if (p.num_top_logprobs < 0 || p.num_top_logprobs > kMaxTopLogprobs)
      c.fail("row {}: num_top_logprobs {} must be in [0, {}]", r, p.num_top_logprobs, kMaxTopLogprobs);
    if (p.penalty_begin < 0 || p.penalty_end < p.penalty_begin ||
        static_cast<size_t>(p.penalty_end) > penalty_tokens.size())
      c.fail("row {}: penalty range [{}, {}) is outside the {} penalty tokens", r, p.penalty_begin, p.penalty_end,
             penalty_tokens.size());
    top_wanted = std::max(top_wanted, p.num_top_logprobs);
  }
  for (size_t i = 0; i < penalty_tokens.size(); ++i) {
    if (penalty_tokens[i].id < 0 || penalty_tokens[i].id >= V)
      c.fail("penalty token {} is {}, outside the vocabulary [0, {})", i, penalty_tokens[i].id, V);
  }
  if (out.logprobs) {
    c.present("logprobs", out.logprobs);
    if (out.logprobs.dtype() != DType::kF32) c.fail("logprobs {} must be F32", out.logprobs.describe());
    c.shape("logprobs", out.logprobs, {R}, "logits", logits);
  }
  if (top_wanted > 0 && (!out.top_ids || !out.top_logprobs))
    c.fail("{} top logprobs wanted but top_ids / top_logprobs are undefined", top_wanted);
  if (out.top_ids || out.top_logprobs) {
    c.i32("top_ids", out.top_ids, 2);
    c.present("top_logprobs", out.top_logprobs);
    if (out.top_logprobs.dtype() != DType::kF32 || out.top_logprobs.shape() != out.top_ids.shape() ||
        out.top_ids.dim(0) != R || out.top_ids.dim(1) < top_wanted)
      c.fail("top_ids {} and top_logprobs {} must be [{}, >= {}] I32 and F32", out.top_ids.describe(),
             out.top_logprobs.describe(), R, top_wanted);
  }
  if (out.nonfinite) {
    c.i32("nonfinite", out.nonfinite, 1);
    c.shape("nonfinite", out.nonfinite, {R}, "logits", logits);
  }
  c.dispatch([&] { cpu::sample_tokens(out, logits, rows, penalty_tokens); },
             [&] { CHIMERA_CUDA_CALL(cuda::sample_tokens(ctx, out, logits, rows, penalty_tokens)); });
}

void sample_tokens(const Context& ctx, const Tensor& out_ids, const Tensor& logits, std::span<const SamplingRow> rows) {
  SamplingOutputs out;
  out.ids = out_ids;
  sample_tokens(ctx, out, logits, rows, {});
}

void accept_drafts_greedy(const Context& ctx, const Tensor& accepted, const Tensor& head_rows,
                          const Tensor& draft_context, const Tensor& tokens, const Tensor& targets,
                          const Tensor& context_lens) {
  const Check c(ctx, "accept_drafts_greedy");
  c.i32("accepted", accepted, 1);
  c.i32("head_rows", head_rows, 1);
  c.i32("tokens", tokens, 1);
  c.i32("targets", targets, 1);
  c.i32("context_lens", context_lens, 1);
  const int64_t n = accepted.dim(0);
  if (n == 0 || tokens.dim(0) % n != 0 || tokens.dim(0) / n < 2) {
    c.fail("tokens {} must hold k + 1 >= 2 rows for each of the {} sequences of accepted {}", tokens.describe(), n,
           accepted.describe());
  }
  const int64_t k = tokens.dim(0) / n - 1;
  c.shape("targets", targets, tokens.shape(), "tokens", tokens);
  c.shape("head_rows", head_rows, {n}, "accepted", accepted);
  c.shape("context_lens", context_lens, {n}, "accepted", accepted);
  if (k > 1) {
    c.i32("draft_context", draft_context, 2);
    c.shape("draft_context", draft_context, {k - 1, n}, "tokens", tokens);
  } else if (draft_context && draft_context.numel() != 0) {
    c.fail("draft_context {} must be empty with one draft a sequence", draft_context.describe());
  }
  c.dispatch([&] { cpu::accept_drafts_greedy(accepted, head_rows, draft_context, tokens, targets, context_lens); },
             [&] {
               CHIMERA_CUDA_CALL(
                   cuda::accept_drafts_greedy(ctx, accepted, head_rows, draft_context, tokens, targets, context_lens));
             });
}

// ---- small helpers ---------------------------------------------------------------------------------

void add(const Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  const Check c(ctx, "add");
  c.f32("a", a, -1);
  c.f32("b", b, -1);
  c.f32("out", out, -1);
  c.shape("b", b, a.shape(), "a", a);
  c.shape("out", out, a.shape(), "a", a);
  c.dispatch([&] { cpu::add(out, a, b); }, [&] { CHIMERA_CUDA_CALL(cuda::add(ctx, out, a, b)); });
}

void copy_columns(const Context& ctx, const Tensor& out, const Tensor& in, int64_t col_begin) {
  const Check c(ctx, "copy_columns");
  c.f32("in", in, 2);
  c.f32("out", out, 2);
  if (out.dim(0) != in.dim(0) || col_begin < 0 || col_begin + out.dim(1) > in.dim(1)) {
    c.fail("out {} does not match columns [{}, {}) of in {}", out.describe(), col_begin, col_begin + out.dim(1),
           in.describe());
  }
  c.dispatch([&] { cpu::copy_columns(out, in, col_begin); }, [&] { CHIMERA_CUDA_CALL(cuda::copy_columns(ctx, out, in, col_begin)); });
}

void write_columns(const Context& ctx, const Tensor& out, const Tensor& in, int64_t col_begin) {
  const Check c(ctx, "write_columns");
  c.f32("in", in, 2);
  c.f32("out", out, 2);
  if (out.dim(0) != in.dim(0) || col_begin < 0 || col_begin + in.dim(1) > out.dim(1)) {
    c.fail("in {} does not match columns [{}, {}) of out {}", in.describe(), col_begin, col_begin + in.dim(1),
           out.describe());
  }
  c.dispatch([&] { cpu::write_columns(out, in, col_begin); },
             [&] { CHIMERA_CUDA_CALL(cuda::write_columns(ctx, out, in, col_begin)); });
}

// ---- tensor parallelism ----------------------------------------------------------------------------

namespace {

// A CUDA tensor through host memory: its fp32 values (after every stream's work on it), then back in its dtype.
// The path of CUDA ranks without device collectives (ops::TpGroup::device), e.g. several ranks on one GPU.
template <typename Fn>
void through_host(const Tensor& x, Fn fn) {
  const Tensor host = device::to_host_f32(x);
  fn(host);
  device::copy(x, device::to_device(host, x.device(), x.dtype()));
}

#ifndef CHIMERA_HAVE_NCCL
[[noreturn]] void no_device_collectives(const char* op) {
  runtime_error("ops::{}: this build has no NCCL (device collectives)", op);
}
#endif

}  // namespace

void all_reduce(const Context& ctx, const Tensor& x, const TpGroup& tp) {
  const Check c(ctx, "all_reduce");
  c.f32("x", x, -1);
  if (!tp.group) c.fail("no communicator");
  const auto sum = [&](const Tensor& h) {
    tp.group->all_reduce_sum(tp.rank, {h.f32(), static_cast<size_t>(h.numel())});
  };
  c.dispatch([&] { sum(x); },
             [&] {
               if (!tp.device) return through_host(x, sum);
#ifdef CHIMERA_HAVE_NCCL
               tp.device->all_reduce(tp.rank, x, ctx.stream);
#else
               no_device_collectives("all_reduce");
#endif
             });
}

void all_reduce_add_rms_norm(const Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& x,
                             const Tensor& weight, float eps, const TpGroup& tp) {
  const Check c(ctx, "all_reduce_add_rms_norm");
  c.f32("x", x, 2);
  c.like("residual", residual, "x", x);
  c.like("out", out, "x", x);
  c.norm_weight("weight", weight, "x", x);
  if (!tp.group) c.fail("no communicator");
  const auto unfused = [&] {
    all_reduce(ctx, x, tp);
    add_rms_norm(ctx, residual, out, x, weight, eps);
  };
  c.dispatch(unfused, [&] {
    // The fused kernels take one dtype for all four tensors (the model's norm weights are in the activation dtype).
    const bool one_dtype = residual.dtype() == x.dtype() && out.dtype() == x.dtype() && weight.dtype() == x.dtype();
    if (!tp.device || !one_dtype) return unfused();
#ifdef CHIMERA_HAVE_NCCL
    tp.device->all_reduce_add_rms_norm(tp.rank, residual, out, x, weight, eps, ctx.stream);
#else
    no_device_collectives("all_reduce_add_rms_norm");
#endif
  });
}

void all_gather_columns(const Context& ctx, const Tensor& out, const Tensor& in, const TpGroup& tp) {
  const Check c(ctx, "all_gather_columns");
  c.f32("in", in, 2);
  c.f32("out", out, 2);
  if (!tp.group) c.fail("no communicator");
  const int64_t R = in.dim(0), C = in.dim(1), n = tp.group->size();
  c.shape("out", out, {R, n * C}, "in", in);
  // Gathered rank-major [n, R, C], then each rank's block written to its columns of out.
  const auto gather_host = [&](const Tensor& h_in, const Tensor& h_out) {
    std::vector<float> all(static_cast<size_t>(n * R * C));
    tp.group->all_gather(tp.rank, {h_in.f32(), static_cast<size_t>(R * C)}, all);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t i = 0; i < R; ++i) {
        std::copy_n(all.data() + (r * R + i) * C, C, h_out.f32() + i * n * C + r * C);
      }
    }
  };
  c.dispatch([&] { gather_host(in, out); },
             [&] {
               if (!tp.device) {
                 const Tensor h_out = Tensor::empty(DType::kF32, out.shape());
                 gather_host(device::to_host_f32(in), h_out);
                 device::copy(out, device::to_device(h_out, Device::kCuda, out.dtype()));
                 return;
               }
#ifdef CHIMERA_HAVE_NCCL
               const Tensor all = device::empty(Device::kCuda, in.dtype(), {n, R, C});
               tp.device->all_gather(tp.rank, in, all, ctx.stream);
               for (int64_t r = 0; r < n; ++r) CHIMERA_CUDA_CALL(cuda::write_columns(ctx, out, all.select(r), r * C));
#else
               no_device_collectives("all_gather_columns");
#endif
             });
}

}  // namespace chimera::ops
