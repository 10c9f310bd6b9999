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
// pointer alignments) holding the descriptors and the algorithm the heuristic chose the first time.
// The workspace is shared by every call of the thread: calls from one thread on two concurrently running
// streams would race on it (the engine runs one stream per thread).
#include <cublasLt.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
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
  // kAuto at decode sizes: the path measured fastest per shape: -1 = cuBLASLt, w > 0 = the GEMV at w warps per row.
  std::unordered_map<PlanKey, int, PlanKeyHash> decode_choice;
  // linear_multi's one GEMV launch: the warps per row measured fastest per shape (out = the parts' rows).
  std::unordered_map<PlanKey, int, PlanKeyHash> multi_choice;
  // residual_norm_linear: the two ops (-1) or the one GEMV launch at w warps per row, measured fastest per shape
  // (key bias: the add2 form); norm_forced_choice: the warps per row under NormFold::kAlways.
  std::unordered_map<PlanKey, int, PlanKeyHash> norm_choice;
  std::unordered_map<PlanKey, int, PlanKeyHash> norm_forced_choice;
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

// Best of 5 timings of 3 back-to-back calls of fn on `stream` (microseconds per call); synchronises the stream. For
// the one-time choice between two paths on a shape (the output is overwritten by the caller's real call).
double time_us(void* stream, const std::function<void()>& fn) {
  cudaStream_t s = as_stream(stream);
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  CHIMERA_CUDA_CHECK(cudaEventCreate(&e0), "ops::linear (path timing)");
  CHIMERA_CUDA_CHECK(cudaEventCreate(&e1), "ops::linear (path timing)");
  float best = 1e30f;
  fn();  // first use: plans, attributes
  for (int rep = 0; rep < 5; ++rep) {
    CHIMERA_CUDA_CHECK(cudaEventRecord(e0, s), "ops::linear (path timing)");
    for (int i = 0; i < 3; ++i) fn();
    CHIMERA_CUDA_CHECK(cudaEventRecord(e1, s), "ops::linear (path timing)");
    CHIMERA_CUDA_CHECK(cudaEventSynchronize(e1), "ops::linear (path timing)");
    float ms = 0.0f;
    CHIMERA_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1), "ops::linear (path timing)");
    best = std::min(best, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 1000.0 * best / 3.0;
}

// The candidate c for which run(c) was fastest on this shape: timed once per key (time_us) on the first call outside
// a CUDA graph capture and cached in `choices`; inside a capture nothing can be timed, so `in_capture` is returned
// uncached and the next call outside a capture decides. Ties go to the earlier candidate.
int fastest(std::unordered_map<PlanKey, int, PlanKeyHash>& choices, const PlanKey& key, void* stream,
            std::initializer_list<int> candidates, int in_capture, const std::function<void(int)>& run) {
  const auto it = choices.find(key);
  if (it != choices.end()) return it->second;
  if (device::stream_capturing(stream)) return in_capture;
  int best = *candidates.begin();
  double best_us = 0.0;
  for (int c : candidates) {
    const double us = time_us(stream, [&] { run(c); });
    if (c == *candidates.begin() || us < best_us) best = c, best_us = us;
  }
  choices.emplace(key, best);
  return best;
}

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

}  // namespace

bool linear_gemv_supported(const Tensor& out, const Tensor& x, const Tensor& weight) {
  return gemv_fits(out, x, weight);
}

void linear(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  linear_on_path(ctx, out, x, weight, bias, LinearPath::kAuto);
}

void linear_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                    const Tensor& bias, LinearPath path) {
  const char* op = "ops::linear";
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
  const bool gemv_ok = gemv_fits(out, x, weight);
  if (path == LinearPath::kGemv && !gemv_ok) {
    throw_runtime(str_cat(op, ": the GEMV path does not take x ", x.describe(), " @ weight ", weight.describe(),
                          " (T <= ", gemm::kGemvMaxTokens, ", 16-bit, K % 8 == 0, 16-byte aligned)"));
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
  const auto run_cublas = [&] {
    const Plan& plan = get_plan(st, key, bias ? bias.data() : nullptr);
    if (bias) {
      const void* b = bias.data();
      CHIMERA_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof(b)), op);
    }
    const float alpha = 1.0f, beta = 0.0f;
    CHIMERA_CUBLAS_CHECK(cublasLtMatmul(st.handle, plan.desc, &alpha, weight.data(), plan.w, x.data(), plan.x, &beta,
                                        out.data(), plan.y, out.data(), plan.y, &plan.algo, st.workspace,
                                        kWorkspaceBytes, as_stream(ctx.stream)),
                         op);
  };

  // -1: cuBLASLt; 0: the GEMV with its own warps-per-row rule; w > 0: the GEMV at w warps per row.
  const auto run = [&](int choice) {
    if (choice < 0) {
      run_cublas();
    } else {
      run_gemv(ctx, out, x, weight, bias, false, choice);
    }
  };
  int choice = path == LinearPath::kGemv ? 0 : -1;
  if (path == LinearPath::kAuto && gemv_ok && T <= kLinearGemvAutoMaxTokens) {
    // Which path wins depends on the shape (bench linear_decode on the H200, T = 1, graph: the GEMV 8.7 vs 10.5 us
    // on the Nano out_proj, 2.3 vs 5.9 on its k/v projections, but 17.7 vs 17.2 on its in_proj), and so does the
    // GEMV's best split of a row over warps (q_proj 10.2 / 8.9 / 11.2 us at 1 / 2 / 4 warps per row, out_proj 8.7 /
    // 9.0 / 9.5, Super out_proj 23.9 / 19.7 / 18.9): cuBLASLt and the GEMV at 1, 2 and 4 warps per row, the fastest
    // kept per shape; inside a capture the GEMV with its own rule.
    choice = fastest(st.decode_choice, key, ctx.stream, {-1, 1, 2, 4}, 0, run);
  }
  run(choice);
}

void linear_multi(const ops::Context& ctx, std::span<const Tensor> outs, const Tensor& x,
                  std::span<const Tensor> weights) {
  // One GEMV launch for all parts when each of them is a GEMV shape at a decode size; else one linear per part.
  bool one_launch = x.dim(0) <= kLinearGemvAutoMaxTokens && weights.size() <= gemm::kGemvMaxParts;
  int64_t rows = 0;
  for (size_t i = 0; one_launch && i < weights.size(); ++i) {
    one_launch = weights[i].dtype() == x.dtype() && outs[i].dtype() == x.dtype() && gemv_fits(outs[i], x, weights[i]);
    rows += weights[i].dim(0);
  }
  if (!one_launch || x.dim(0) == 0 || rows >= (int64_t{1} << 31) / std::max<int64_t>(1, x.dim(1))) {
    for (size_t i = 0; i < weights.size(); ++i) cuda::linear(ctx, outs[i], x, weights[i], Tensor());
    return;
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
  // Warps per row as cuda::linear picks them: the fastest of 1, 2, 4 per shape; inside a capture the GEMV's own rule.
  const PlanKey key{x.dim(0), x.dim(1), rows, x.dtype(), false, 256u, alignment(x.data()), 256u, 256u};
  const auto run = [&](int w) {
    p.warps_per_row = w;
    gemm::launch_gemv(p, x.dtype(), false, as_stream(ctx.stream));
  };
  run(fastest(lt_state().multi_choice, key, ctx.stream, {1, 2, 4}, 0, run));
}

namespace {
// residual_norm_linear's one-launch GEMV path (NormFold); CHIMERA_RESIDUAL_NORM_FOLD=0|1|2 sets the default.
std::atomic<int> g_norm_fold{[] {
  const char* v = std::getenv("CHIMERA_RESIDUAL_NORM_FOLD");
  return v == nullptr ? static_cast<int>(NormFold::kAuto) : std::clamp(std::atoi(v), 0, 2);
}()};
}  // namespace

NormFold set_residual_norm_fold(NormFold fold) {
  return static_cast<NormFold>(g_norm_fold.exchange(static_cast<int>(fold)));
}

namespace {
// The norm layout's threads per row when the one-launch path applies to these arguments (16-bit, T <= 2, the norm
// kernel's layout for the row at kGemvNormVecs vectors per thread within the GEMV's 256 threads, every weight a GEMV
// shape, ...) and is not turned off; 0 otherwise.
int fused_norm_threads(const ops::ResidualNorm& rn, std::span<const Tensor> outs, std::span<const Tensor> weights,
                       const Tensor& bias) {
  const DType act = rn.a.dtype();
  const int64_t T = rn.a.dim(0), D = rn.a.dim(1);
  if (g_norm_fold.load(std::memory_order_relaxed) == static_cast<int>(NormFold::kOff) || T < 1 ||
      T > kLinearGemvAutoMaxTokens) {
    return 0;
  }
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
}  // namespace

bool residual_norm_linear_fused(const ops::ResidualNorm& rn, std::span<const Tensor> outs,
                                std::span<const Tensor> weights, const Tensor& bias) {
  return fused_norm_threads(rn, outs, weights, bias) > 0;
}

void residual_norm_linear(const ops::Context& ctx, const ops::ResidualNorm& rn, std::span<const Tensor> outs,
                          std::span<const Tensor> weights, const Tensor& bias) {
  const char* op = "ops::residual_norm_linear";
  require_same_dtype(op, {{"a", &rn.a}, {"residual", &rn.residual}, {"residual_out", &rn.residual_out}, {"x", &rn.x}});
  if (rn.b) require_same_dtype(op, {{"a", &rn.a}, {"b", &rn.b}});
  const int64_t T = rn.a.dim(0), D = rn.a.dim(1);
  if (T == 0) return;
  if (D > (int64_t{1} << 30)) throw_runtime(str_cat(op, ": hidden size ", D, " exceeds one row of the norm kernel"));
  gemm::GemvParams p;
  const int norm_threads = fused_norm_threads(rn, outs, weights, bias);
  // -1: the two ops; w >= 0: the one GEMV launch at w warps per row (0: the GEMV's own rule).
  const auto run = [&](int choice) {
    if (choice >= 0) {
      p.warps_per_row = choice;
      gemm::launch_gemv(p, rn.a.dtype(), false, as_stream(ctx.stream));
      return;
    }
    // The two ops: the norm kernel with the residual written out of place, then the dense layer(s).
    const norm::RowNormParams np{rn.x.data(), rn.a.data(), rn.b ? rn.b.data() : nullptr, rn.residual.data(),
                                 rn.norm_weight.data(), T, static_cast<int>(D), 1, rn.eps, rn.residual_out.data()};
    if (rn.b) {
      norm::launch_add2_rms_norm(np, rn.a.dtype(), rn.norm_weight.dtype(), as_stream(ctx.stream));
    } else {
      norm::launch_add_rms_norm(np, rn.a.dtype(), rn.norm_weight.dtype(), as_stream(ctx.stream));
    }
    if (weights.size() == 1) {
      cuda::linear(ctx, outs[0], rn.x, weights[0], bias);
    } else {
      cuda::linear_multi(ctx, outs, rn.x, weights);
    }
  };
  if (norm_threads == 0) return run(-1);
  p.norm = {rn.residual.data(), rn.a.data(), rn.b ? rn.b.data() : nullptr, rn.residual_out.data(),
            rn.norm_weight.data(), rn.eps, norm_threads};
  p.n_parts = static_cast<int>(weights.size());
  int64_t rows = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    p.parts[i] = {weights[i].data(), i == 0 && bias ? bias.data() : nullptr, outs[i].data(),
                  static_cast<int>(weights[i].dim(0))};
    rows += weights[i].dim(0);
  }
  p.T = static_cast<int>(T);
  p.K = static_cast<int>(D);
  p.N = static_cast<int>(rows);
  const PlanKey key{T, D, rows, rn.a.dtype(), static_cast<bool>(rn.b), 256u, 256u, 256u, bias ? 16u : 256u};
  // The fastest of the two ops and the one launch at 1, 2, 4 warps per row, timed per shape (every candidate reads
  // residual, a and b and writes residual_out and the outputs, so the timing runs repeat the real call's results).
  // Measured (bench norm_linear_decode, graph): the one launch wins at T = 1 (Nano in_proj 18.1 vs 19.6 us, q/k/v
  // 9.5 vs 12.2) but not on the Nano in_proj at T = 2 (23.1 vs 19.7: cuBLASLt's tensor cores there). Inside a
  // capture, before any timing, the one launch with the GEMV's own rule.
  if (g_norm_fold.load(std::memory_order_relaxed) == static_cast<int>(NormFold::kAlways)) {
    return run(fastest(lt_state().norm_forced_choice, key, ctx.stream, {1, 2, 4}, 0, run));
  }
  run(fastest(lt_state().norm_choice, key, ctx.stream, {-1, 1, 2, 4}, 0, run));
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
