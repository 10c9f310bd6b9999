// Dense layers through cuBLASLt: y[T, out] = x[T, in] @ W[out, in]^T (+ b), and relu2_mlp.
//
// Row-major y = x W^T is column-major y^T = W x^T: cuBLASLt's A is W seen column-major as [in, out] (ld in)
// with TRANSA = T, its B is x seen column-major as [in, T] (ld in), and D is y^T as [out, T] (ld out).
// The bias is cuBLASLt's BIAS epilogue (a vector over D's rows = out features, in D's dtype).
// Types: BF16 / F16 in and out with fp32 accumulation (CUBLAS_COMPUTE_32F); F32 with CUBLAS_COMPUTE_32F,
// never TF32 (the fp32 path must match the CPU reference to 1e-10 normalised MSE).
// One activation dtype per call, and the weight in that dtype (the engine converts weights at load time):
// a mismatch fails loudly naming both rather than converting a whole weight on every call.
//
// Per thread (cuBLASLt handles and descriptors are not shared across threads): one handle, one 32 MiB
// workspace (NVIDIA's recommendation for Hopper), and a plan cache keyed by (T, in, out, dtype, bias,
// pointer alignments) holding the descriptors and the algorithm the heuristic returns for that key (a deterministic
// function of the key on a given cuBLASLt and device, so the same shape runs the same algorithm on every run).
// At decode sizes (T <= kLinearGemvAutoMaxTokens) the plan of linear.h picks cuBLASLt or the GEMV per shape from
// the tuned table (sm90_linear_table.inc) or its rule: never by timing at run time.
// The workspace is shared by every call of the thread: calls from one thread on two concurrently running
// streams would race on it (the engine runs one stream per thread).
#include <cublasLt.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/gemm/gemv.h"
#include "backends/cuda/gemm/linear.h"
#include "backends/cuda/norm/row_norm.cuh"
#include "backends/device_api.h"
#include "backends/profiler_events.h"

namespace chimera::cuda {
namespace {

#define CHIMERA_CUBLAS_CHECK(expr, op)                                                                                \
  do {                                                                                                                \
    const cublasStatus_t chimera_st_ = (expr);                                                                        \
    if (chimera_st_ != CUBLAS_STATUS_SUCCESS) {                                                                       \
      ::chimera::throw_runtime(::chimera::str_cat((op), ": ", #expr, " failed: ", cublasLtGetStatusName(chimera_st_), \
                                                  " (", cublasLtGetStatusString(chimera_st_), ")"));                  \
    }                                                                                                                 \
  } while (0)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    default: throw_runtime(str_cat("ops::linear: dtype ", dtype_name(d), " is not supported on CUDA (F32, BF16, F16)"));
  }
}

// Largest power of two (<= 256) dividing the address: what cuBLASLt's alignment preferences ask for.
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  uint32_t al = 1;
  while (al < 256 && a % (al * 2) == 0) al *= 2;
  return al;
}

struct PlanKey {
  int64_t tokens, in, out;
  DType dtype;
  bool bias;
  uint32_t align_w, align_x, align_y, align_b;
  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(static_cast<uint64_t>(k.tokens));
    mix(static_cast<uint64_t>(k.in));
    mix(static_cast<uint64_t>(k.out));
    mix(static_cast<uint64_t>(k.dtype) | (uint64_t{k.bias} << 8));
    mix((uint64_t{k.align_w} << 32) | k.align_x);
    mix((uint64_t{k.align_y} << 32) | k.align_b);
    return h;
  }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// Per-thread cuBLASLt state; never destroyed (thread-exit destructors may run after the CUDA context is gone).
struct LtState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
};

LtState& lt_state() {
  thread_local LtState* s = [] {
    auto* st = new LtState();
    CHIMERA_CUBLAS_CHECK(cublasLtCreate(&st->handle), "ops::linear");
    CHIMERA_CUDA_CHECK(cudaMalloc(&st->workspace, kWorkspaceBytes), "ops::linear workspace");
    return st;
  }();
  return *s;
}

const Plan& get_plan(LtState& st, const PlanKey& k, const void* bias) {
  auto it = st.plans.find(k);
  if (it != st.plans.end()) return it->second;
  const char* op = "ops::linear";
  const cudaDataType_t t = cuda_type(k.dtype);
  Plan p;
  CHIMERA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), op);
  const cublasOperation_t trans_w = CUBLAS_OP_T, trans_x = CUBLAS_OP_N;
  CHIMERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_w, sizeof(trans_w)),
                       op);
  CHIMERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_x, sizeof(trans_x)),
                       op);
  if (k.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    CHIMERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), op);
    CHIMERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
                         op);
  }
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  CHIMERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.w, t, u(k.in), u(k.out), k.in), op);
  CHIMERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.x, t, u(k.in), u(k.tokens), k.in), op);
  CHIMERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.y, t, u(k.out), u(k.tokens), k.out), op);

  cublasLtMatmulPreference_t pref = nullptr;
  CHIMERA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref), op);
  const size_t ws = kWorkspaceBytes;
  CHIMERA_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), op);
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, k.align_w},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, k.align_x},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, k.align_y},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, k.align_y}};
  for (const auto& [attr, value] : aligns) {
    CHIMERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)), op);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st_h =
      cublasLtMatmulAlgoGetHeuristic(st.handle, p.desc, p.w, p.x, p.y, p.y, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st_h != CUBLAS_STATUS_SUCCESS || found == 0) {
    throw_runtime(str_cat(op, ": cuBLASLt has no algorithm for x ", dtype_name(k.dtype), "[", k.tokens, ", ", k.in,
                          "] @ weight^T [", k.out, ", ", k.in, "]", k.bias ? " + bias" : "", " (alignments w ",
                          k.align_w, ", x ", k.align_x, ", y ", k.align_y, "): ", cublasLtGetStatusName(st_h)));
  }
  p.algo = result.algo;
  return st.plans.emplace(k, p).first->second;
}

}  // namespace

namespace {

// The GEMV path's launch for out = x @ weight^T (+ bias) (+ relu^2).
void run_gemv(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
              bool relu2, int warps_per_row = 0) {
  gemm::GemvParams p;
  p.warps_per_row = warps_per_row;
  p.x = x.data();
  p.parts[0] = {weight.data(), bias ? bias.data() : nullptr, out.data(), static_cast<int>(weight.dim(0))};
  p.T = static_cast<int>(x.dim(0));
  p.K = static_cast<int>(x.dim(1));
  p.N = static_cast<int>(weight.dim(0));
  gemm::launch_gemv(p, x.dtype(), relu2, as_stream(ctx.stream));
}

bool gemv_fits(const Tensor& out, const Tensor& x, const Tensor& weight) {
  return gemm::gemv_supported(x.dim(0), x.dim(1), weight.dim(0), x.dtype(), x.data(), weight.data(), out.data());
}

constexpr LinearPlanEntry kLinearPlanTable[] = {
#include "backends/cuda/gemm/sm90_linear_table.inc"
};

void check_choice(const char* op, int choice, bool separate_ok) {
  if (!(choice == 0 || choice == 1 || choice == 2 || choice == 4 || (separate_ok && choice == kSeparate))) {
    throw_runtime(str_cat(op, ": plan choice ", choice, " is not one of ", separate_ok ? "-1, " : "", "0, 1, 2, 4"));
  }
}

}  // namespace

std::span<const LinearPlanEntry> linear_plan_table() { return kLinearPlanTable; }

int linear_plan_choice(LinearKind kind, int64_t tokens, int64_t in, int64_t out) {
  for (const LinearPlanEntry& e : kLinearPlanTable) {
    if (e.kind == kind && e.tokens == tokens && e.in == in && e.out == out) return e.choice;
  }
  switch (kind) {
    case LinearKind::kLinear:
    case LinearKind::kMulti:
      return 0;
    case LinearKind::kNormAdd:
    case LinearKind::kNormAdd2:
      return tokens == 1 ? 0 : kSeparate;
  }
  return 0;
}

bool linear_gemv_supported(const Tensor& out, const Tensor& x, const Tensor& weight) {
  return gemv_fits(out, x, weight);
}

void linear(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const int64_t T = x.dim(0);
  // The plan: at decode sizes, where the GEMV takes the shape, the table's (or the rule's) choice; cuBLASLt otherwise.
  const bool gemv_ok = T >= 1 && T <= kLinearGemvAutoMaxTokens && x.dtype() == weight.dtype() &&
                       out.dtype() == x.dtype() && (!bias || bias.dtype() == x.dtype()) && x.dim(1) > 0 &&
                       gemv_fits(out, x, weight);
  const int choice = gemv_ok ? linear_plan_choice(LinearKind::kLinear, T, x.dim(1), weight.dim(0)) : kSeparate;
  linear_with_choice(ctx, out, x, weight, bias, choice);
}

void linear_with_choice(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, int choice) {
  const char* op = "ops::linear";
  check_choice(op, choice, true);
  require_same_dtype(op, {{"x", &x}, {"out", &out}});
  if (weight.dtype() != x.dtype()) {
    throw_runtime(str_cat(op, ": weight ", weight.describe(), " must have the activation dtype of x ", x.describe(),
                          " on CUDA (convert weights once at load time)"));
  }
  if (bias && bias.dtype() != x.dtype()) {
    throw_runtime(
        str_cat(op, ": bias ", bias.describe(), " must have the activation dtype of x ", x.describe(), " on CUDA"));
  }
  const int64_t T = x.dim(0), in = x.dim(1), n_out = weight.dim(0);
  if (T == 0 || n_out == 0) return;
  if (in == 0) throw_runtime(str_cat(op, ": in_features 0 (x ", x.describe(), ") is not supported on CUDA"));
  if (choice != kSeparate) {
    if (!gemv_fits(out, x, weight)) {
      throw_runtime(str_cat(op, ": the GEMV path does not take x ", x.describe(), " @ weight ", weight.describe(),
                            " (T <= ", gemm::kGemvMaxTokens, ", 16-bit, K % 8 == 0, 16-byte aligned)"));
    }
    run_gemv(ctx, out, x, weight, bias, false, choice);
    return;
  }
  LtState& st = lt_state();
  const PlanKey key{T,
                    in,
                    n_out,
                    x.dtype(),
                    static_cast<bool>(bias),
                    alignment(weight.data()),
                    alignment(x.data()),
                    alignment(out.data()),
                    bias ? alignment(bias.data()) : 256u};
  const Plan& plan = get_plan(st, key, bias ? bias.data() : nullptr);
  if (bias) {
    const void* b = bias.data();
    CHIMERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof(b)),
                         op);
  }
  const float alpha = 1.0f, beta = 0.0f;
  CHIMERA_CUBLAS_CHECK(cublasLtMatmul(st.handle, plan.desc, &alpha, weight.data(), plan.w, x.data(), plan.x, &beta,
                                      out.data(), plan.y, out.data(), plan.y, &plan.algo, st.workspace,
                                      kWorkspaceBytes, as_stream(ctx.stream)),
                       op);
}

namespace {
// Whether linear_multi's one GEMV launch takes these parts (each a GEMV shape at a decode size); the rows summed.
bool multi_one_launch(std::span<const Tensor> outs, const Tensor& x, std::span<const Tensor> weights, int64_t& rows) {
  bool ok = x.dim(0) >= 1 && x.dim(0) <= kLinearGemvAutoMaxTokens && weights.size() <= gemm::kGemvMaxParts;
  rows = 0;
  for (size_t i = 0; ok && i < weights.size(); ++i) {
    ok = weights[i].dtype() == x.dtype() && outs[i].dtype() == x.dtype() && gemv_fits(outs[i], x, weights[i]);
    rows += weights[i].dim(0);
  }
  return ok && rows < (int64_t{1} << 31) / std::max<int64_t>(1, x.dim(1));
}
}  // namespace

void linear_multi(const ops::Context& ctx, std::span<const Tensor> outs, const Tensor& x,
                  std::span<const Tensor> weights) {
  // One GEMV launch for all parts when each of them is a GEMV shape at a decode size; else one linear per part.
  int64_t rows = 0;
  if (!multi_one_launch(outs, x, weights, rows)) {
    for (size_t i = 0; i < weights.size(); ++i) cuda::linear(ctx, outs[i], x, weights[i], Tensor());
    return;
  }
  linear_multi_with_choice(ctx, outs, x, weights, linear_plan_choice(LinearKind::kMulti, x.dim(0), x.dim(1), rows));
}

void linear_multi_with_choice(const ops::Context& ctx, std::span<const Tensor> outs, const Tensor& x,
                              std::span<const Tensor> weights, int choice) {
  const char* op = "ops::linear_multi";
  check_choice(op, choice, false);
  int64_t rows = 0;
  if (!multi_one_launch(outs, x, weights, rows)) {
    throw_runtime(str_cat(op, ": the one GEMV launch does not take x ", x.describe(), " with ", weights.size(),
                          " weights (T <= ", kLinearGemvAutoMaxTokens, ", each part a GEMV shape)"));
  }
  gemm::GemvParams p;
  p.x = x.data();
  p.n_parts = static_cast<int>(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    p.parts[i] = {weights[i].data(), nullptr, outs[i].data(), static_cast<int>(weights[i].dim(0))};
  }
  p.T = static_cast<int>(x.dim(0));
  p.K = static_cast<int>(x.dim(1));
  p.N = static_cast<int>(rows);
  p.warps_per_row = choice;
  gemm::launch_gemv(p, x.dtype(), false, as_stream(ctx.stream));
}

namespace {
// The norm layout's threads per row when the one-launch path applies to these arguments (16-bit, T <= 2, the norm
// kernel's layout for the row at kGemvNormVecs vectors per thread within the GEMV's 256 threads, every weight a GEMV
// shape, ...) and ctx.kernels allows it; 0 otherwise.
int fused_norm_threads(const ops::Context& ctx, const ops::ResidualNorm& rn, std::span<const Tensor> outs,
                       std::span<const Tensor> weights, const Tensor& bias) {
  const DType act = rn.a.dtype();
  const int64_t T = rn.a.dim(0), D = rn.a.dim(1);
  if (!ctx.kernels.residual_norm_fold || T < 1 || T > kLinearGemvAutoMaxTokens) return 0;
  if ((act != DType::kBF16 && act != DType::kF16) || rn.norm_weight.dtype() != act || D % 8 != 0) return 0;
  for (const Tensor* t : {&rn.residual, &rn.residual_out, &rn.b}) {
    if (*t && t->dtype() != act) return 0;
  }
  if (!vec_aligned({rn.residual.data(), rn.residual_out.data(), rn.a.data(), rn.b ? rn.b.data() : nullptr,
                    rn.norm_weight.data()})) {
    return 0;
  }
  const int n_vec = static_cast<int>(D / 8);
  if (norm::default_vecs_per_thread(n_vec) != gemm::kGemvNormVecs) return 0;
  const int threads = norm::threads_per_row(n_vec, gemm::kGemvNormVecs);
  if (threads < 1 || threads > 256) return 0;
  if (bias && (weights.size() != 1 || bias.dtype() != act)) return 0;
  int64_t rows = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (weights[i].dtype() != act || outs[i].dtype() != act) return 0;
    if (!gemm::gemv_supported(T, D, weights[i].dim(0), act, nullptr, weights[i].data(), outs[i].data())) return 0;
    rows += weights[i].dim(0);
  }
  const bool fits = weights.size() <= static_cast<size_t>(gemm::kGemvMaxParts) && rows < (int64_t{1} << 31) / D;
  return fits ? threads : 0;
}

int64_t total_rows(std::span<const Tensor> weights) {
  int64_t rows = 0;
  for (const Tensor& w : weights) rows += w.dim(0);
  return rows;
}
}  // namespace

bool residual_norm_linear_fused(const ops::Context& ctx, const ops::ResidualNorm& rn, std::span<const Tensor> outs,
                                std::span<const Tensor> weights, const Tensor& bias) {
  return fused_norm_threads(ctx, rn, outs, weights, bias) > 0;
}

void residual_norm_linear(const ops::Context& ctx, const ops::ResidualNorm& rn, std::span<const Tensor> outs,
                          std::span<const Tensor> weights, const Tensor& bias) {
  const bool fused = fused_norm_threads(ctx, rn, outs, weights, bias) > 0;
  const LinearKind kind = rn.b ? LinearKind::kNormAdd2 : LinearKind::kNormAdd;
  const int choice = fused ? linear_plan_choice(kind, rn.a.dim(0), rn.a.dim(1), total_rows(weights)) : kSeparate;
  residual_norm_linear_with_choice(ctx, rn, outs, weights, bias, choice);
}

void residual_rms_norm(const ops::Context& ctx, const ops::ResidualNorm& rn) {
  const char* op = "ops::residual_rms_norm";
  require_same_dtype(op, {{"a", &rn.a}, {"residual", &rn.residual}, {"residual_out", &rn.residual_out}, {"x", &rn.x}});
  if (rn.b) require_same_dtype(op, {{"a", &rn.a}, {"b", &rn.b}});
  const int64_t T = rn.a.dim(0), D = rn.a.dim(1);
  if (T == 0) return;
  if (D > (int64_t{1} << 30)) throw_runtime(str_cat(op, ": hidden size ", D, " exceeds one row of the norm kernel"));
  const norm::RowNormParams np{rn.x.data(), rn.a.data(), rn.b ? rn.b.data() : nullptr, rn.residual.data(),
                               rn.norm_weight.data(), T, static_cast<int>(D), 1, rn.eps, rn.residual_out.data()};
  if (rn.b) {
    norm::launch_add2_rms_norm(np, rn.a.dtype(), rn.norm_weight.dtype(), as_stream(ctx.stream));
  } else {
    norm::launch_add_rms_norm(np, rn.a.dtype(), rn.norm_weight.dtype(), as_stream(ctx.stream));
  }
}

void residual_norm_linear_with_choice(const ops::Context& ctx, const ops::ResidualNorm& rn,
                                      std::span<const Tensor> outs, std::span<const Tensor> weights,
                                      const Tensor& bias, int choice) {
  const char* op = "ops::residual_norm_linear";
  check_choice(op, choice, true);
  require_same_dtype(op, {{"a", &rn.a}, {"residual", &rn.residual}, {"residual_out", &rn.residual_out}, {"x", &rn.x}});
  if (rn.b) require_same_dtype(op, {{"a", &rn.a}, {"b", &rn.b}});
  const int64_t T = rn.a.dim(0), D = rn.a.dim(1);
  if (T == 0) return;
  if (D > (int64_t{1} << 30)) throw_runtime(str_cat(op, ": hidden size ", D, " exceeds one row of the norm kernel"));
  if (choice == kSeparate) {
    // The two ops: the norm kernel with the residual written out of place, then the dense layer(s).
    cuda::residual_rms_norm(ctx, rn);  // qualified: ADL also finds ops::residual_rms_norm
    if (weights.size() == 1) {
      cuda::linear(ctx, outs[0], rn.x, weights[0], bias);
    } else {
      cuda::linear_multi(ctx, outs, rn.x, weights);
    }
    return;
  }
  const int norm_threads = fused_norm_threads(ctx, rn, outs, weights, bias);
  if (norm_threads == 0) {
    throw_runtime(str_cat(op, ": the one-launch path does not take a ", rn.a.describe(), " with ", weights.size(),
                          " weights (16-bit, T <= ", kLinearGemvAutoMaxTokens,
                          ", GEMV shapes, aligned rows, ctx.kernels.residual_norm_fold)"));
  }
  // One GEMV launch: every block recomputes the residual step for its rows (bit-identical to the norm kernel).
  gemm::GemvParams p;
  p.norm = {rn.residual.data(), rn.a.data(), rn.b ? rn.b.data() : nullptr, rn.residual_out.data(),
            rn.norm_weight.data(), rn.eps, norm_threads};
  p.n_parts = static_cast<int>(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) {
    p.parts[i] = {weights[i].data(), i == 0 && bias ? bias.data() : nullptr, outs[i].data(),
                  static_cast<int>(weights[i].dim(0))};
  }
  p.T = static_cast<int>(T);
  p.K = static_cast<int>(D);
  p.N = static_cast<int>(total_rows(weights));
  p.warps_per_row = choice;
  gemm::launch_gemv(p, rn.a.dtype(), false, as_stream(ctx.stream));
}

// down(relu(up(x))^2): two GEMMs around the in-place relu2 kernel (at decode sizes the up GEMV applies relu^2); the [T, I] intermediate is in the
// activation dtype (as in HF, where the MLP runs in the model dtype).
void relu2_mlp(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& up_proj,
               const Tensor& down_proj) {
  const Tensor h = device::empty(Device::kCuda, x.dtype(), {x.dim(0), up_proj.dim(0)});
  if (x.dim(0) <= kLinearGemvAutoMaxTokens && gemv_fits(h, x, up_proj)) {
    run_gemv(ctx, h, x, up_proj, Tensor(), true);  // relu^2 in the GEMV's epilogue, same roundings
  } else {
    cuda::linear(ctx, h, x, up_proj, Tensor());
    cuda::relu2(ctx, h);
  }
  cuda::linear(ctx, out, h, down_proj, Tensor());
}

}  // namespace chimera::cuda
