// Router (noaux_tc sigmoid top-k) and routed experts against naive per-token loops; on CUDA also against the
// CPU reference at the Nemotron shapes (routing choices bit-exact, weights fp32-elementwise, expert outputs by
// the reduction rows of tests/common/tolerances.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/moe/experts.h"
#endif

namespace chimera {
namespace {

using test::BackendTest;

// Backend plumbing that also works in a CUDA build on a machine without a GPU (the Cpu instances never touch
// the device API there): inputs moved to the backend, poisoned outputs, results brought back to the host.
class MoeBackendTest : public BackendTest {
 protected:
  Tensor in(const Tensor& host) const { return on_cuda() ? on_backend(host) : host; }
  Tensor in(const Tensor& host, DType dtype) const {
    if (on_cuda()) return on_backend(host, dtype);
    return host.dtype() == dtype ? host : test::cast_to(host.to_f32(), dtype);
  }
  Tensor out(DType dtype, Shape shape) const {
    if (on_cuda()) return output(dtype, std::move(shape));
    Tensor t = Tensor::empty(dtype, std::move(shape));
    test::poison(t);
    return t;
  }
  static Tensor host(const Tensor& t) { return t.device() == Device::kCuda ? device::to_host(t) : t; }
  static Tensor host_f32(const Tensor& t) { return t.device() == Device::kCuda ? device::to_host_f32(t) : t.to_f32(); }
};

// The CPU reference router (itself checked against naive_router below).
void cpu_router(const Tensor& logits, const Tensor& bias, const ops::RouterParams& p, Tensor& ids, Tensor& w) {
  ids = Tensor::empty(DType::kI32, {logits.dim(0), p.top_k});
  w = Tensor::empty(DType::kF32, {logits.dim(0), p.top_k});
  ops::router_topk(ops::Context{}, ids, w, logits, bias, p);
}

// Values rounded through a 16-bit dtype (what a BF16 / F16 activation holds).
Tensor round_to(const Tensor& f32, DType dtype) { return dtype == DType::kF32 ? f32 : test::cast_to(f32, dtype).to_f32(); }

// Naive router following HF NemotronHMoE.route_tokens_to_experts, with ties resolved toward lower indices.
void naive_router(const Tensor& logits, const Tensor& bias, const ops::RouterParams& p, Tensor& ids, Tensor& w) {
  const int64_t T = logits.dim(0), E = logits.dim(1), per = E / p.n_group;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      score[e] = 1.0f / (1.0f + std::exp(-logits.f32()[t * E + e]));  // fp32 sigmoid, as the op
      choice[e] = float(float(score[e]) + bias.f32()[e]);
    }
    std::vector<bool> allowed(static_cast<size_t>(E), true);
    if (p.n_group > 1) {
      std::vector<std::pair<double, int64_t>> groups;
      for (int64_t g = 0; g < p.n_group; ++g) {
        std::vector<double> vals(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(vals.rbegin(), vals.rend());
        groups.push_back({-(vals[0] + (per > 1 ? vals[1] : 0.0)), g});
      }
      std::sort(groups.begin(), groups.end());  // by descending score, then ascending group index
      std::fill(allowed.begin(), allowed.end(), false);
      for (int64_t r = 0; r < p.topk_group; ++r) {
        for (int64_t e = 0; e < per; ++e) allowed[groups[r].second * per + e] = true;
      }
    }
    std::vector<std::pair<double, int64_t>> order;
    for (int64_t e = 0; e < E; ++e) order.push_back({allowed[e] ? -choice[e] : INFINITY, e});
    std::sort(order.begin(), order.end());
    double sum = 0;
    for (int64_t r = 0; r < p.top_k; ++r) sum += float(score[order[r].second]);
    for (int64_t r = 0; r < p.top_k; ++r) {
      const int64_t e = order[r].second;
      ids.i32()[t * p.top_k + r] = int32_t(e);
      const double wv = p.norm_topk_prob ? float(score[e]) / (sum + 1e-20) : float(score[e]);
      w.f32()[t * p.top_k + r] = float(wv * p.routed_scaling_factor);
    }
  }
}

class OpsRouter : public MoeBackendTest {
 protected:
  // Routes on the backend under test (outputs poisoned first); ids and w come back as host tensors.
  void route(const Tensor& logits, const Tensor& bias, const ops::RouterParams& p, Tensor& ids, Tensor& w) {
    Tensor d_ids = out(DType::kI32, {logits.dim(0), p.top_k}), d_w = out(DType::kF32, {logits.dim(0), p.top_k});
    ops::router_topk(ctx(), d_ids, d_w, in(logits), in(bias), p);
    ids = host(d_ids);
    w = host_f32(d_w);
  }
};

TEST_P(OpsRouter, RandomLogitsMatchNaive) {
  auto rng = test::Rng::for_test();
  for (int64_t n_group : {1, 2, 8}) {
    for (bool norm : {true, false}) {
      for (int64_t T : {1, 17, 111}) {
        const int64_t E = 64;
        ops::RouterParams p{6, n_group, n_group > 1 ? n_group / 2 : 1, norm, 2.5f};
        SCOPED_TRACE(::testing::Message() << "T=" << T << " n_group=" << n_group << " norm=" << norm);
        const Tensor logits = rng.normal_tensor({T, E}, 2.0f), bias = rng.normal_tensor({E}, 0.1f);
        Tensor ids, w;
        route(logits, bias, p, ids, w);
        Tensor want_ids = Tensor::empty(DType::kI32, ids.shape()), want_w = Tensor::empty(DType::kF32, w.shape());
        naive_router(logits, bias, p, want_ids, want_w);
        EXPECT_TRUE(test::bit_equal(ids, want_ids));
        EXPECT_ALL_CLOSE(w, want_w, test::kF32Elementwise);
      }
    }
  }
}

TEST_P(OpsRouter, ExactTiesGoToLowerIndex) {
  // Experts 1, 3, 4, 6 tie exactly for the top; 0 is lower; then the output is sorted by value.
  const Tensor logits = Tensor::from_f32({1, 8}, std::vector<float>{-1.0f, 0.5f, 0.0f, 0.5f, 0.5f, -2.0f, 0.5f, 0.0f});
  const Tensor bias = Tensor::zeros(DType::kF32, {8});
  Tensor ids, w;
  route(logits, bias, {3, 1, 1, true, 1.0f}, ids, w);
  EXPECT_TRUE(test::bit_equal(ids, Tensor::from_i32({1, 3}, std::vector<int32_t>{1, 3, 4})));
  route(logits, bias, {6, 1, 1, true, 1.0f}, ids, w);
  EXPECT_TRUE(test::bit_equal(ids, Tensor::from_i32({1, 6}, std::vector<int32_t>{1, 3, 4, 6, 2, 7})));
  for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(w.f32()[r], w.f32()[0]);
}

TEST_P(OpsRouter, GroupMaskingKeepsTheBestGroups) {
  // All scores 0.5; the bias shapes choice. Group sums of the top-2 choice values (groups of 2):
  // g0 {1.5, -0.5} = 1.0, g1 {0.8, 0.8} = 1.6, g2 {0.7, 0.7} = 1.4, g3 {0.5, 0.5} = 1.0 (ties g0).
  const Tensor logits = Tensor::zeros(DType::kF32, {1, 8});
  const Tensor bias = Tensor::from_f32({8}, std::vector<float>{1.0f, -1.0f, 0.3f, 0.3f, 0.2f, 0.2f, 0.0f, 0.0f});
  Tensor ids, w;
  // Two groups kept (g1, g2): expert 0, the best single choice, is masked out.
  route(logits, bias, {2, 4, 2, true, 1.0f}, ids, w);
  EXPECT_TRUE(test::bit_equal(ids, Tensor::from_i32({1, 2}, std::vector<int32_t>{2, 3})));
  // Three groups kept: g0 wins its tie with g3 (lower group index), so the six candidates are 0..5.
  route(logits, bias, {6, 4, 3, true, 1.0f}, ids, w);
  EXPECT_TRUE(test::bit_equal(ids, Tensor::from_i32({1, 6}, std::vector<int32_t>{0, 2, 3, 4, 5, 1})));
  // Without groups expert 0 comes first.
  route(logits, bias, {2, 1, 1, true, 1.0f}, ids, w);
  EXPECT_TRUE(test::bit_equal(ids, Tensor::from_i32({1, 2}, std::vector<int32_t>{0, 2})));
}

TEST_P(OpsRouter, BiasOnlyAffectsSelection) {
  // Logits favour expert 0, the bias flips the choice to expert 3; weights stay unbiased sigmoid scores.
  const std::vector<float> lv = {2.0f, 1.0f, 0.0f, -1.0f};
  const Tensor logits = Tensor::from_f32({1, 4}, lv);
  const Tensor bias = Tensor::from_f32({4}, std::vector<float>{0.0f, 0.0f, 0.0f, 1.0f});
  Tensor ids, w;
  route(logits, bias, {2, 1, 1, false, 2.5f}, ids, w);
  EXPECT_TRUE(test::bit_equal(ids, Tensor::from_i32({1, 2}, std::vector<int32_t>{3, 0})));
  const float s3 = 1.0f / (1.0f + std::exp(1.0f)), s0 = 1.0f / (1.0f + std::exp(-2.0f));
  EXPECT_FLOAT_EQ(w.f32()[0], s3 * 2.5f);
  EXPECT_FLOAT_EQ(w.f32()[1], s0 * 2.5f);
  route(logits, bias, {2, 1, 1, true, 2.5f}, ids, w);
  EXPECT_NEAR(w.f32()[0], s3 / (s3 + s0) * 2.5f, 1e-6);
  EXPECT_NEAR(w.f32()[0] + w.f32()[1], 2.5f, 1e-6);
}

TEST_P(OpsRouter, BadParamsThrowNamingTheOp) {
  const Tensor logits = in(Tensor::zeros(DType::kF32, {2, 12})), bias = in(Tensor::zeros(DType::kF32, {12}));
  Tensor ids = out(DType::kI32, {2, 4}), w = out(DType::kF32, {2, 4});
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::router_topk(ctx(), ids, w, logits, bias, {4, 5, 1, true, 1.0f});
      },
      ErrorKind::kRuntime, "ops::router_topk: n_group 5 does not divide the 12 experts"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::router_topk(ctx(), ids, w, logits, bias, {4, 4, 1, true, 1.0f});
      },
      ErrorKind::kRuntime, "ops::router_topk: top_k 4 is not in [1, 3]"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::router_topk(ctx(), ids, w, logits, bias, {3, 1, 1, true, 1.0f});
      },
      ErrorKind::kRuntime, "ops::router_topk: topk_ids I32[2, 4] does not match logits"));
}

// Random routing at the model shapes and the awkward token counts. CUDA is compared with the CPU reference
// (choices bit-exact) at every size; the CPU instance with the naive oracle at the smaller ones.
struct RouterCase {
  int64_t E, k, n_group, topk_group;
  float scale;
};
constexpr RouterCase kRouterCases[] = {{8, 2, 1, 1, 1.0f},   {128, 6, 1, 1, 2.5f},  {512, 22, 1, 1, 5.0f},
                                       {512, 8, 1, 1, 1.0f}, {100, 7, 1, 1, 1.0f},  {256, 32, 1, 1, 1.0f},
                                       {33, 5, 1, 1, 1.0f},  {256, 8, 8, 4, 2.5f},  {128, 6, 2, 1, 1.0f},
                                       {512, 22, 8, 2, 5.0f}};

void expect_routes_match(const Tensor& ids, const Tensor& w, const Tensor& want_ids, const Tensor& want_w) {
  EXPECT_TRUE(test::bit_equal(ids, want_ids));
  EXPECT_ALL_CLOSE(w, want_w, test::kF32Elementwise);
}

TEST_P(OpsRouter, ModelShapesMatchTheReference) {
  auto rng = test::Rng::for_test();
  for (const RouterCase& c : kRouterCases) {
    for (int64_t T : {1, 3, 17, 111, 989, 4099}) {
      if (!on_cuda() && T > 111) continue;
      SCOPED_TRACE(::testing::Message() << "E=" << c.E << " k=" << c.k << " n_group=" << c.n_group << " T=" << T);
      const ops::RouterParams p{c.k, c.n_group, c.topk_group, true, c.scale};
      const Tensor logits = rng.normal_tensor({T, c.E}, 2.0f), bias = rng.normal_tensor({c.E}, 0.05f);
      Tensor ids, w, want_ids, want_w;
      route(logits, bias, p, ids, w);
      if (on_cuda()) {
        cpu_router(logits, bias, p, want_ids, want_w);
      } else {
        want_ids = Tensor::empty(DType::kI32, ids.shape());
        want_w = Tensor::empty(DType::kF32, w.shape());
        naive_router(logits, bias, p, want_ids, want_w);
      }
      expect_routes_match(ids, w, want_ids, want_w);
    }
  }
}

TEST_P(OpsRouter, QuantizedScoresTieExactlyAtScale) {
  // Logits and bias on coarse grids: most biased scores tie exactly with others; every tie goes to the lower
  // expert index, and the output stays sorted by (score desc, index asc).
  auto rng = test::Rng::for_test();
  for (const RouterCase& c : kRouterCases) {
    const int64_t T = on_cuda() ? 989 : 17;
    SCOPED_TRACE(::testing::Message() << "E=" << c.E << " k=" << c.k << " n_group=" << c.n_group);
    Tensor logits = Tensor::empty(DType::kF32, {T, c.E}), bias = Tensor::empty(DType::kF32, {c.E});
    for (int64_t i = 0; i < logits.numel(); ++i) logits.f32()[i] = 0.5f * static_cast<float>(rng.integer(-4, 4));
    for (int64_t e = 0; e < c.E; ++e) bias.f32()[e] = 0.125f * static_cast<float>(rng.integer(0, 2));
    const ops::RouterParams p{c.k, c.n_group, c.topk_group, true, c.scale};
    Tensor ids, w, want_ids, want_w;
    route(logits, bias, p, ids, w);
    if (on_cuda()) {
      cpu_router(logits, bias, p, want_ids, want_w);
    } else {
      // The naive oracle sums group scores in double: near-equal float group sums may order differently.
      if (c.n_group > 1) continue;
      want_ids = Tensor::empty(DType::kI32, ids.shape());
      want_w = Tensor::empty(DType::kF32, w.shape());
      naive_router(logits, bias, p, want_ids, want_w);
    }
    expect_routes_match(ids, w, want_ids, want_w);
  }
}

CHIMERA_INSTANTIATE_BACKENDS(OpsRouter);

// ---- router from its input (router_gate_topk) --------------------------------------------------------------

// The reference: CPU fp32 logits (ops::linear of x as the backend sees it, i.e. already rounded to x's dtype)
// and the CPU router_topk, the two ops router_gate_topk replaces.
void cpu_gate_router(const Tensor& x32, const Tensor& gate, const Tensor& bias, const ops::RouterParams& p, Tensor& ids,
                     Tensor& w, Tensor* logits_out = nullptr) {
  Tensor logits = Tensor::empty(DType::kF32, {x32.dim(0), gate.dim(0)});
  ops::linear(ops::Context{}, logits, x32, gate);
  cpu_router(logits, bias, p, ids, w);
  if (logits_out) *logits_out = logits;
}

// Values i / denom with i in [-4, 4]: with x on a 1/8 grid and the gate on a 1/64 grid, every product is a multiple
// of 2^-9 below 2^-5 in magnitude and any partial sum of up to 2^15 of them is exact in fp32, so the logits are
// the same bits in every summation order and the fused kernel must match the reference bit for bit.
Tensor grid_tensor(test::Rng& rng, Shape shape, float denom) {
  Tensor t = Tensor::empty(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = static_cast<float>(rng.integer(-4, 4)) / denom;
  return t;
}

// Whether fp32 summation-order noise in token t's logits could change its routing: a gap below `margin` between
// adjacent biased scores among the top k + 1 of the allowed experts (the choices and their output order), or
// between the topk_group-th and the next group score.
bool near_tie(const float* logits, const float* bias, int64_t E, const ops::RouterParams& p, double margin) {
  std::vector<double> c(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) c[e] = 1.0 / (1.0 + std::exp(-double(logits[e]))) + bias[e];
  const int64_t per = E / p.n_group;
  std::vector<bool> allowed(static_cast<size_t>(E), true);
  if (p.n_group > 1) {
    std::vector<std::pair<double, int64_t>> groups;
    for (int64_t g = 0; g < p.n_group; ++g) {
      std::vector<double> v(c.begin() + g * per, c.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({v[0] + (per > 1 ? v[1] : 0.0), g});
    }
    std::sort(groups.rbegin(), groups.rend());
    if (p.topk_group < p.n_group && groups[p.topk_group - 1].first - groups[p.topk_group].first < margin) return true;
    std::fill(allowed.begin(), allowed.end(), false);
    for (int64_t r = 0; r < p.topk_group; ++r) {
      for (int64_t e = 0; e < per; ++e) allowed[groups[r].second * per + e] = true;
    }
  }
  std::vector<double> v;
  for (int64_t e = 0; e < E; ++e) {
    if (allowed[e]) v.push_back(c[e]);
  }
  std::sort(v.rbegin(), v.rend());
  for (int64_t r = 0; r < p.top_k && r + 1 < static_cast<int64_t>(v.size()); ++r) {
    if (v[r] - v[r + 1] < margin) return true;
  }
  return false;
}

class OpsRouterGate : public MoeBackendTest {
 protected:
  // Routes from x (converted to x_dtype on the backend) on the backend under test; outputs poisoned first. On CUDA
  // `cluster` is KernelConfig::router_cluster for the call: on, decode sizes (T <= 4) with a gate slice that fits
  // take the single-cluster kernel; off, the split-K kernel (moe_kernels.h).
  void route(const Tensor& x, DType x_dtype, const Tensor& gate, const Tensor& bias, const ops::RouterParams& p,
             Tensor& ids, Tensor& w, bool cluster = true) {
    Tensor d_ids = out(DType::kI32, {x.dim(0), p.top_k}), d_w = out(DType::kF32, {x.dim(0), p.top_k});
    {
      ops::Context c = ctx();
      c.kernels.router_cluster = cluster;
      ops::router_gate_topk(c, d_ids, d_w, in(x, x_dtype), in(gate), in(bias), p);
    }
    ids = host(d_ids);
    w = host_f32(d_w);
  }
  std::vector<DType> x_dtypes() const {
    return on_cuda() ? std::vector<DType>{DType::kF32, DType::kBF16, DType::kF16} : std::vector<DType>{DType::kF32};
  }
  // Both CUDA kernels of the decode sizes (the cluster switch on, then off); one pass on the CPU.
  std::vector<bool> cluster_settings() const { return on_cuda() ? std::vector<bool>{true, false} : std::vector<bool>{true}; }
};

// Nano (E 128 / top-6 on hidden 2688), Super (512 / top-22 on 4096), group-limited routing (the 512-expert one
// needs more than 48 KiB of shared memory at T = 16), super_like-sized groups, a hidden size that is not a multiple
// of 4 (scalar gate loads) and odd expert counts.
struct GateCase {
  int64_t E, k, n_group, topk_group;
  float scale;
  int64_t D;
};
constexpr GateCase kGateCases[] = {{128, 6, 1, 1, 2.5f, 2688}, {512, 22, 1, 1, 5.0f, 4096}, {256, 8, 8, 4, 2.5f, 1024},
                                   {512, 22, 8, 2, 5.0f, 4096}, {16, 3, 4, 2, 2.5f, 40},    {33, 5, 1, 1, 1.0f, 37},
                                   {100, 7, 1, 1, 1.0f, 200},   {8, 2, 1, 1, 1.0f, 4}};
// 1..16: the fused CUDA kernel (decode sizes); 17, 64: the convert + GEMM + router_topk path.
constexpr int64_t kGateTokens[] = {1, 2, 3, 4, 8, 16, 17, 64};

TEST_P(OpsRouterGate, ExactLogitsGiveTheReferenceChoices) {
  auto rng = test::Rng::for_test();
  for (const GateCase& c : kGateCases) {
    const Tensor gate = grid_tensor(rng, {c.E, c.D}, 64.0f), bias = rng.normal_tensor({c.E}, 0.05f);
    const ops::RouterParams p{c.k, c.n_group, c.topk_group, true, c.scale};
    for (DType xt : x_dtypes()) {
      for (int64_t T : kGateTokens) {
        SCOPED_TRACE(::testing::Message() << "E=" << c.E << " k=" << c.k << " n_group=" << c.n_group << " D=" << c.D
                                          << " T=" << T << " x=" << dtype_name(xt));
        const Tensor x = grid_tensor(rng, {T, c.D}, 8.0f);  // exact in bf16 and f16 too
        Tensor want_ids, want_w;
        cpu_gate_router(x, gate, bias, p, want_ids, want_w);
        for (bool cluster : cluster_settings()) {
          SCOPED_TRACE(::testing::Message() << "cluster switch " << cluster);
          Tensor ids, w;
          route(x, xt, gate, bias, p, ids, w, cluster);
          EXPECT_TRUE(test::bit_equal(ids, want_ids));
          // The weights' normalising sum runs in rank order on the CPU and as a warp butterfly on CUDA: one ulp apart.
          EXPECT_ALL_CLOSE(w, want_w, test::kF32Elementwise);
        }
      }
    }
  }
}

// Random x and gate (logits of order 1): the choices are exact except where fp32 summation order could flip a
// near-tie (such tokens are counted and skipped; there must be few), the weights fp32-elementwise.
TEST_P(OpsRouterGate, RandomInputsMatchAwayFromNearTies) {
  auto rng = test::Rng::for_test();
  int64_t tokens = 0, skipped = 0;
  for (const GateCase& c : kGateCases) {
    const Tensor gate = rng.normal_tensor({c.E, c.D}, 1.0f / std::sqrt(static_cast<float>(c.D)));
    const Tensor bias = rng.normal_tensor({c.E}, 0.05f);
    const ops::RouterParams p{c.k, c.n_group, c.topk_group, true, c.scale};
    for (DType xt : x_dtypes()) {
      for (int64_t T : kGateTokens) {
        SCOPED_TRACE(::testing::Message() << "E=" << c.E << " k=" << c.k << " n_group=" << c.n_group << " D=" << c.D
                                          << " T=" << T << " x=" << dtype_name(xt));
        const Tensor x = round_to(rng.normal_tensor({T, c.D}), xt);
        Tensor want_ids, want_w, logits;
        cpu_gate_router(x, gate, bias, p, want_ids, want_w, &logits);
        for (bool cluster : cluster_settings()) {
          SCOPED_TRACE(::testing::Message() << "cluster switch " << cluster);
          Tensor ids, w;
          route(x, xt, gate, bias, p, ids, w, cluster);
          for (int64_t t = 0; t < T; ++t) {
            ++tokens;
            if (on_cuda() && near_tie(logits.f32() + t * c.E, bias.f32(), c.E, p, 1e-5)) {
              ++skipped;
              continue;
            }
            SCOPED_TRACE(::testing::Message() << "token " << t);
            EXPECT_TRUE(test::bit_equal(ids.select(t).clone(), want_ids.select(t).clone()));
            EXPECT_ALL_CLOSE(w.select(t).clone(), want_w.select(t).clone(), test::kF32Elementwise);
          }
        }
      }
    }
  }
  std::printf("router_gate_topk: %lld of %lld tokens skipped as near-ties\n", static_cast<long long>(skipped),
              static_cast<long long>(tokens));
  EXPECT_LE(skipped * 20, tokens);
}

// Many calls back to back with changing shapes (grid sizes) and, on CUDA, alternating kernels (the cluster switch
// on / off every call): the split-K kernel's ticket counter must be back at zero after every launch, or a later call
// routes from incomplete logits.
TEST_P(OpsRouterGate, RepeatedCallsWithChangingShapes) {
  auto rng = test::Rng::for_test();
  const GateCase cases[] = {kGateCases[0], kGateCases[2], kGateCases[6]};
  std::vector<Tensor> gates, biases;
  for (const GateCase& c : cases) {
    gates.push_back(grid_tensor(rng, {c.E, c.D}, 64.0f));
    biases.push_back(rng.normal_tensor({c.E}, 0.05f));
  }
  for (int i = 0; i < (on_cuda() ? 120 : 12); ++i) {
    const size_t ci = static_cast<size_t>(i) % 3;
    const GateCase& c = cases[ci];
    const int64_t T = 1 + (i * 7) % 16;
    SCOPED_TRACE(::testing::Message() << "call " << i << " E=" << c.E << " T=" << T);
    const ops::RouterParams p{c.k, c.n_group, c.topk_group, true, c.scale};
    const Tensor x = grid_tensor(rng, {T, c.D}, 8.0f);
    Tensor ids, w, want_ids, want_w;
    route(x, on_cuda() ? DType::kBF16 : DType::kF32, gates[ci], biases[ci], p, ids, w, (i / 3) % 2 == 0);
    cpu_gate_router(x, gates[ci], biases[ci], p, want_ids, want_w);
    ASSERT_TRUE(test::bit_equal(ids, want_ids));
    EXPECT_ALL_CLOSE(w, want_w, test::kF32Elementwise);  // the normalising sum's order differs (see above)
  }
}

// The Nano router (E 128 / top-6, D 2688, fp32 gate) at T = 1..4 takes the cluster kernel when the switch is on (so
// the cases above check it and cannot pass on the split-K kernel alone), and not when it is off, at T = 5, or for
// Super's gate (512 x 4096 fp32 does not fit the CTAs' shared memory).
TEST_P(OpsRouterGate, ClusterKernelRunsAtNanoDecodeSizes) {
  if (!on_cuda()) GTEST_SKIP() << "a CUDA kernel choice";
#ifdef CHIMERA_HAVE_CUDA
  auto rng = test::Rng::for_test();
  for (const GateCase& c : {kGateCases[0], kGateCases[1]}) {
    const Tensor gate = grid_tensor(rng, {c.E, c.D}, 64.0f), bias = rng.normal_tensor({c.E}, 0.05f);
    const ops::RouterParams p{c.k, c.n_group, c.topk_group, true, c.scale};
    const bool nano = c.E == 128;
    for (int64_t T : {1, 2, 3, 4, 5}) {
      const Tensor x = grid_tensor(rng, {T, c.D}, 8.0f);
      Tensor want_ids, want_w;
      cpu_gate_router(x, gate, bias, p, want_ids, want_w);
      for (bool cluster : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "E=" << c.E << " T=" << T << " cluster switch " << cluster);
        Tensor ids, w;
        route(x, DType::kBF16, gate, bias, p, ids, w, cluster);
        const int used = cuda::moe::router_gate_last_cluster();
        if (cluster && nano && T <= 4) {
          EXPECT_TRUE(used == 16 || used == 8) << "cluster size " << used;
        } else {
          EXPECT_EQ(used, 0);
        }
        EXPECT_TRUE(test::bit_equal(ids, want_ids));
        EXPECT_ALL_CLOSE(w, want_w, test::kF32Elementwise);
      }
    }
  }
#endif
}

// PDL ordering: x is written by the kernel launched right before the router on the same stream (ops::convert into
// poisoned NaN memory, x the last T rows of a large output so its blocks finish late); the router must read x only
// after that kernel completes. Both kernels, the Nano shape and an odd one (D % 4 != 0: the plain-load paths).
TEST_P(OpsRouterGate, RoutesTheXThePreviousKernelWrote) {
  auto rng = test::Rng::for_test();
  for (const GateCase& c : {kGateCases[0], kGateCases[5]}) {
    const Tensor gate = grid_tensor(rng, {c.E, c.D}, 64.0f), bias = rng.normal_tensor({c.E}, 0.05f);
    const Tensor d_gate = in(gate), d_bias = in(bias);
    const ops::RouterParams p{c.k, c.n_group, c.topk_group, true, c.scale};
    const int64_t rows = on_cuda() ? (int64_t{16} << 20) / c.D : 8;  // 16 Mi elements through the convert on CUDA
    const Tensor src = grid_tensor(rng, {rows, c.D}, 8.0f);                // exact in bf16
    const Tensor d_src = in(src);
    for (int64_t T : {1, 2, 3, 4}) {
      const Tensor x = src.rows(rows - T, rows).clone();
      Tensor want_ids, want_w;
      cpu_gate_router(x, gate, bias, p, want_ids, want_w);
      for (bool cluster : cluster_settings()) {
        SCOPED_TRACE(::testing::Message() << "E=" << c.E << " D=" << c.D << " T=" << T << " cluster switch " << cluster);
        const Tensor d_all = out(on_cuda() ? DType::kBF16 : DType::kF32, {rows, c.D});  // poisoned
        Tensor d_ids = out(DType::kI32, {T, p.top_k}), d_w = out(DType::kF32, {T, p.top_k});
        {
          ops::Context rc = ctx();
          rc.kernels.router_cluster = cluster;
          ops::convert(rc, d_all, d_src);
          ops::router_gate_topk(rc, d_ids, d_w, d_all.rows(rows - T, rows), d_gate, d_bias, p);
        }
        EXPECT_TRUE(test::bit_equal(host(d_ids), want_ids));
        EXPECT_ALL_CLOSE(host_f32(d_w), want_w, test::kF32Elementwise);
      }
    }
  }
}

TEST_P(OpsRouterGate, BadShapesThrowNamingTheOp) {
  const Tensor x = in(Tensor::zeros(DType::kF32, {2, 6}));
  const Tensor gate = in(Tensor::zeros(DType::kF32, {8, 6})), bias = in(Tensor::zeros(DType::kF32, {8}));
  Tensor ids = out(DType::kI32, {2, 2}), w = out(DType::kF32, {2, 2});
  const ops::RouterParams p{2, 1, 1, true, 1.0f};
  EXPECT_TRUE(test::throws_error(
      [&] { ops::router_gate_topk(ctx(), ids, w, x, in(Tensor::zeros(DType::kF32, {8, 7})), bias, p); },
      ErrorKind::kRuntime, "ops::router_gate_topk: gate F32[8, 7] does not match x F32[2, 6]"));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::router_gate_topk(ctx(), ids, w, x, gate, in(Tensor::zeros(DType::kF32, {5})), p); },
      ErrorKind::kRuntime, "ops::router_gate_topk: correction_bias F32[5] does not match gate F32[8, 6]"));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::router_gate_topk(ctx(), out(DType::kI32, {3, 2}), w, x, gate, bias, p); }, ErrorKind::kRuntime,
      "ops::router_gate_topk: topk_ids I32[3, 2] does not match x F32[2, 6]"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsRouterGate);

// ---- experts ---------------------------------------------------------------------------------------

// out[t] = sum over its choices, in increasing expert order, of w * down_e(relu(up_e(x[t]))^2); double.
Tensor naive_experts(const Tensor& x, const Tensor& ids, const Tensor& w, const std::vector<Tensor>& up,
                     const std::vector<Tensor>& down) {
  const int64_t T = x.dim(0), Din = x.dim(1), k = ids.dim(1);
  Tensor out = Tensor::empty(DType::kF32, {T, Din});
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> acc(static_cast<size_t>(Din), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids.i32()[t * k + j];
      const Tensor u = up[e].to_f32(), d = down[e].to_f32();
      const int64_t I = u.dim(0);
      std::vector<double> h(static_cast<size_t>(I));
      for (int64_t i = 0; i < I; ++i) {
        double s = 0;
        for (int64_t c = 0; c < Din; ++c) s += double(u.f32()[i * Din + c]) * x.f32()[t * Din + c];
        h[i] = s > 0 ? s * s : 0.0;
      }
      for (int64_t c = 0; c < Din; ++c) {
        double s = 0;
        for (int64_t i = 0; i < I; ++i) s += double(d.f32()[c * I + i]) * h[i];
        acc[c] += w.f32()[t * k + j] * s;
      }
    }
    for (int64_t c = 0; c < Din; ++c) out.f32()[t * Din + c] = float(acc[c]);
  }
  return out;
}

class OpsMoe : public MoeBackendTest {
 public:
  // Runs the op on the backend under test: x converted to x_dtype there, expert weights as given (host tensors
  // or views, moved to the backend one by one unless `device_up` / `device_down` are given). Returns host f32.
  Tensor run(const Tensor& x, DType x_dtype, const Tensor& ids, const Tensor& w, const std::vector<Tensor>& up,
             const std::vector<Tensor>& down) {
    std::vector<Tensor> d_up, d_down;
    for (size_t e = 0; e < up.size(); ++e) {
      d_up.push_back(in(up[e]));
      d_down.push_back(in(down[e]));
    }
    return run_on(x, x_dtype, ids, w, d_up, d_down);
  }
  Tensor run_on(const Tensor& x, DType x_dtype, const Tensor& ids, const Tensor& w, const std::vector<Tensor>& d_up,
                const std::vector<Tensor>& d_down) {
    Tensor o = out(x_dtype, x.shape());
    ops::moe_experts(ctx(), o, in(x, x_dtype), in(ids), in(w), d_up, d_down);
    return host_f32(o);
  }
};

// Routing for the expert tests: the CPU reference router on random logits (distinct experts per token).
void random_routing(test::Rng& rng, int64_t T, int64_t E, int64_t k, float scale, Tensor& ids, Tensor& w) {
  cpu_router(rng.normal_tensor({T, E}), rng.normal_tensor({E}, 0.1f), {k, 1, 1, true, scale}, ids, w);
}

// Weights with std 1/sqrt(fan_in) (outputs of order 1), uniform for speed at the model shapes.
Tensor init_weight(test::Rng& rng, Shape shape, DType dtype) {
  const float a = std::sqrt(3.0f / static_cast<float>(shape.back()));
  return test::cast_to(rng.uniform_tensor(std::move(shape), -a, a), dtype);
}

TEST_P(OpsMoe, ExpertsMatchNaivePerTokenLoop) {
  auto rng = test::Rng::for_test();
  for (DType wt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t T : {1, 3, 17, 111}) {
      const int64_t E = 7, k = 3, Din = 33, I = 20;
      SCOPED_TRACE(::testing::Message() << dtype_name(wt) << " T=" << T);
      std::vector<Tensor> up, down;
      for (int64_t e = 0; e < E; ++e) {
        up.push_back(test::cast_to(rng.normal_tensor({I, Din}, 0.2f), wt));
        down.push_back(test::cast_to(rng.normal_tensor({Din, I}, 0.2f), wt));
      }
      // Distinct experts per token via the router (expert 6 may go unused: fine).
      Tensor ids, w;
      random_routing(rng, T, E, k, 2.5f, ids, w);
      const Tensor x = rng.normal_tensor({T, Din});
      const Tensor got = run(x, DType::kF32, ids, w, up, down);
      EXPECT_TRUE(
          test::nmse_close(got, naive_experts(x, ids, w, up, down), test::kF32ReductionNmse, test::kF32Reduction));
    }
  }
}

// ---- CUDA: 16-bit activations, the tensor-core path, the model shapes -------------------------------------

// The CPU reference (fp32 on the same rounded inputs) for the rows `sample` of a batch.
Tensor cpu_reference_rows(const Tensor& x_rounded, const Tensor& ids, const Tensor& w, const std::vector<Tensor>& up,
                          const std::vector<Tensor>& down, const std::vector<int64_t>& sample) {
  const int64_t n = static_cast<int64_t>(sample.size()), Din = x_rounded.dim(1), k = ids.dim(1);
  Tensor xs = Tensor::empty(DType::kF32, {n, Din}), is = Tensor::empty(DType::kI32, {n, k});
  Tensor ws = Tensor::empty(DType::kF32, {n, k}), o = Tensor::empty(DType::kF32, {n, Din});
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(x_rounded.f32() + sample[r] * Din, Din, xs.f32() + r * Din);
    std::copy_n(ids.i32() + sample[r] * k, k, is.i32() + r * k);
    std::copy_n(w.f32() + sample[r] * k, k, ws.f32() + r * k);
  }
  ops::moe_experts(ops::Context{}, o, xs, is, ws, up, down);
  return o;
}

Tensor pick_rows(const Tensor& f32, const std::vector<int64_t>& sample) {
  const int64_t D = f32.dim(1);
  Tensor o = Tensor::empty(DType::kF32, {static_cast<int64_t>(sample.size()), D});
  for (size_t r = 0; r < sample.size(); ++r) std::copy_n(f32.f32() + sample[r] * D, D, o.f32() + r * D);
  return o;
}

std::vector<int64_t> all_rows(int64_t T) {
  std::vector<int64_t> v(static_cast<size_t>(T));
  std::iota(v.begin(), v.end(), 0);
  return v;
}
// Up to n rows spread over [0, T), first and last included.
std::vector<int64_t> spread_rows(int64_t T, int64_t n) {
  if (T <= n) return all_rows(T);
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(i * (T - 1) / (n - 1));
  return v;
}

test::Tolerance tolerance_for(DType x_dtype) {
  return x_dtype == DType::kF32 ? test::kF32Reduction : test::kBF16Reduction;
}
double nmse_for(DType x_dtype) { return x_dtype == DType::kF32 ? test::kF32ReductionNmse : test::kBF16ReductionNmse; }

// Expert parallelism: local_expert_ids maps the router's ids to a rank's experts (-1 for another rank's), and the
// experts op on the rank's experts with those ids gives the rank's part of the sum; the parts add up to the whole.
// T = 1 and 2 take the CUDA GEMV path, larger T the tensor-core one (bf16); ranks of 1 / 2 / 4 experts.
TEST_P(OpsMoe, ExpertParallelRanksAddUpToTheWholeSum) {
  auto rng = test::Rng::for_test();
  const int64_t E = 8, k = 3, Din = 40, I = 24;
  std::vector<DType> x_dtypes = {DType::kF32};
  if (on_cuda()) x_dtypes.push_back(DType::kBF16);
  for (const DType xd : x_dtypes) {
    std::vector<Tensor> up, down;
    for (int64_t e = 0; e < E; ++e) {
      up.push_back(init_weight(rng, {I, Din}, xd));
      down.push_back(init_weight(rng, {Din, I}, xd));
    }
    for (int64_t T : {1, 2, 19, 133}) {
      Tensor ids, w;
      random_routing(rng, T, E, k, 2.5f, ids, w);
      const Tensor x = xd == DType::kF32 ? rng.normal_tensor({T, Din}) : round_to(rng.normal_tensor({T, Din}), xd);
      const Tensor whole = cpu_reference_rows(x, ids, w, up, down, all_rows(T));
      for (int64_t N : {2, 4, 8}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(xd) << " T=" << T << " N=" << N);
        const int64_t count = E / N;
        Tensor sum = Tensor::zeros(DType::kF32, {T, Din});
        for (int64_t r = 0; r < N; ++r) {
          const Tensor local = in(ids.clone());
          ops::local_expert_ids(ctx(), local, r * count, count);
          const Tensor got_ids = host(local);
          for (int64_t i = 0; i < ids.numel(); ++i) {
            const int32_t e = ids.i32()[i];
            const int32_t want = e >= r * count && e < (r + 1) * count ? static_cast<int32_t>(e - r * count) : -1;
            ASSERT_EQ(got_ids.i32()[i], want) << "pair " << i << " rank " << r;
          }
          const std::vector<Tensor> rank_up(up.begin() + r * count, up.begin() + (r + 1) * count);
          const std::vector<Tensor> rank_down(down.begin() + r * count, down.begin() + (r + 1) * count);
          Tensor o = out(xd, x.shape());
          std::vector<Tensor> d_up, d_down;
          for (int64_t e = 0; e < count; ++e) {
            d_up.push_back(in(rank_up[static_cast<size_t>(e)]));
            d_down.push_back(in(rank_down[static_cast<size_t>(e)]));
          }
          ops::moe_experts(ctx(), o, in(x, xd), local, in(w), d_up, d_down);
          const Tensor part = host_f32(o);
          for (int64_t i = 0; i < sum.numel(); ++i) sum.f32()[i] += part.f32()[i];
        }
        EXPECT_TRUE(test::nmse_close(sum, whole, xd == DType::kF32 ? test::kF32ReductionNmse : test::kBF16ReductionNmse,
                                     xd == DType::kF32 ? test::kF32Reduction : test::kBF16Reduction));
      }
    }
  }
}

TEST_P(OpsMoe, TensorCorePathMatchesTheCpuReference) {
  if (!on_cuda()) GTEST_SKIP() << "16-bit activations are a CUDA feature (the CPU reference is F32)";
  auto rng = test::Rng::for_test();
  // Din 72 and I 200 leave K and N tails for both tile shapes; the experts are views into one fused tensor.
  const int64_t E = 8, k = 2, Din = 72, I = 200;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const Tensor up_fused = init_weight(rng, {E, I, Din}, dt), down_fused = init_weight(rng, {E, Din, I}, dt);
    const Tensor d_up_fused = in(up_fused), d_down_fused = in(down_fused);
    std::vector<Tensor> up, down, d_up, d_down;
    for (int64_t e = 0; e < E; ++e) {
      up.push_back(up_fused.select(e));
      down.push_back(down_fused.select(e));
      d_up.push_back(d_up_fused.select(e));
      d_down.push_back(d_down_fused.select(e));
    }
    for (int64_t T : {1, 3, 17, 111, 989, 4099}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " T=" << T);
      Tensor ids, w;
      random_routing(rng, T, E, k, 2.5f, ids, w);
      const Tensor x = round_to(rng.normal_tensor({T, Din}), dt);
      const Tensor got = run_on(x, dt, ids, w, d_up, d_down);
      const Tensor want = cpu_reference_rows(x, ids, w, up, down, all_rows(T));
      EXPECT_TRUE(test::nmse_close(got, want, test::kBF16ReductionNmse, test::kBF16Reduction));
      // Deterministic: a second run gives the same bits.
      EXPECT_TRUE(test::bit_equal(run_on(x, dt, ids, w, d_up, d_down), got));
    }
  }
}

TEST_P(OpsMoe, SixteenBitActivationsWithOddSizesOrMixedWeights) {
  if (!on_cuda()) GTEST_SKIP() << "16-bit activations are a CUDA feature (the CPU reference is F32)";
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t Din, I;
    DType x, w;
  };
  // Odd sizes or a weight dtype unlike x: the fp32 SIMT path with 16-bit input and output.
  for (Case c : {Case{33, 20, DType::kBF16, DType::kBF16}, Case{64, 48, DType::kBF16, DType::kF32},
                 Case{40, 24, DType::kF16, DType::kBF16}}) {
    for (int64_t T : {1, 17, 111}) {
      SCOPED_TRACE(::testing::Message() << "x " << dtype_name(c.x) << " w " << dtype_name(c.w) << " T=" << T);
      const int64_t E = 6, k = 3;
      std::vector<Tensor> up, down;
      for (int64_t e = 0; e < E; ++e) {
        up.push_back(init_weight(rng, {c.I, c.Din}, c.w));
        down.push_back(init_weight(rng, {c.Din, c.I}, c.w));
      }
      Tensor ids, w;
      random_routing(rng, T, E, k, 2.5f, ids, w);
      const Tensor x = round_to(rng.normal_tensor({T, c.Din}), c.x);
      const Tensor got = run(x, c.x, ids, w, up, down);
      // h stays fp32 on this path: only the output is rounded, so the tight bf16 elementwise bound holds.
      EXPECT_TRUE(test::nmse_close(got, cpu_reference_rows(x, ids, w, up, down, all_rows(T)),
                                   test::kBF16ReductionNmse, test::kBF16Elementwise));
    }
  }
}

// Model shapes: E experts of [I, Din] / [Din, I]; `distinct` weight pairs are cycled over the E expert slots (the
// kernels see E separate pointers) so the test stays fast; the CPU reference runs on up to 8 of the tokens.
void model_shape_case(OpsMoe& t, DType x_dtype, int64_t E, int64_t k, int64_t Din, int64_t I, float scale,
                      std::initializer_list<int64_t> tokens) {
  auto rng = test::Rng::for_test();
  constexpr int64_t kDistinct = 4;
  std::vector<Tensor> pool_up, pool_down, d_pool_up, d_pool_down;
  for (int64_t i = 0; i < kDistinct; ++i) {
    pool_up.push_back(init_weight(rng, {I, Din}, DType::kBF16));
    pool_down.push_back(init_weight(rng, {Din, I}, DType::kBF16));
    d_pool_up.push_back(device::to_device(pool_up.back(), Device::kCuda));
    d_pool_down.push_back(device::to_device(pool_down.back(), Device::kCuda));
  }
  std::vector<Tensor> up, down, d_up, d_down;
  for (int64_t e = 0; e < E; ++e) {
    up.push_back(pool_up[e % kDistinct]);
    down.push_back(pool_down[e % kDistinct]);
    d_up.push_back(d_pool_up[e % kDistinct]);
    d_down.push_back(d_pool_down[e % kDistinct]);
  }
  for (int64_t T : tokens) {
    SCOPED_TRACE(::testing::Message() << "x " << dtype_name(x_dtype) << " E=" << E << " T=" << T);
    Tensor ids, w;
    random_routing(rng, T, E, k, scale, ids, w);
    const Tensor x = round_to(rng.normal_tensor({T, Din}), x_dtype);
    const Tensor got = t.run_on(x, x_dtype, ids, w, d_up, d_down);
    const std::vector<int64_t> sample = spread_rows(T, 8);
    EXPECT_TRUE(test::nmse_close(pick_rows(got, sample), cpu_reference_rows(x, ids, w, up, down, sample),
                                 nmse_for(x_dtype), tolerance_for(x_dtype)));
  }
}

TEST_P(OpsMoe, NanoShapesBf16) {
  if (!on_cuda()) GTEST_SKIP() << "model shapes run on CUDA only (the CPU reference is checked on small ones)";
  // T <= 8: the decode GEMV path (moe_kernels.h, kGemvMaxTokens); 9 and up: tensor cores.
  model_shape_case(*this, DType::kBF16, 128, 6, 2688, 1856, 2.5f, {1, 2, 3, 5, 8, 9, 17, 111, 989});
}

TEST_P(OpsMoe, NanoShapesF32Activations) {
  if (!on_cuda()) GTEST_SKIP() << "model shapes run on CUDA only (the CPU reference is checked on small ones)";
  model_shape_case(*this, DType::kF32, 128, 6, 2688, 1856, 2.5f, {1, 17, 111, 989});
}

TEST_P(OpsMoe, SuperLatentShapesBf16) {
  if (!on_cuda()) GTEST_SKIP() << "model shapes run on CUDA only (the CPU reference is checked on small ones)";
  // T <= 8: the GEMV path (up K = 1024: its short-row shape; down K = 2688: the long one); then tensor cores.
  model_shape_case(*this, DType::kBF16, 512, 22, 1024, 2688, 5.0f, {1, 3, 8, 17, 64, 257});
}

#ifdef CHIMERA_HAVE_CUDA
// Expert weights for the path tests: `distinct` random pairs cycled over E slots (E separate device pointers).
struct ExpertSet {
  std::vector<Tensor> up, down, d_up, d_down;
};
ExpertSet make_experts(test::Rng& rng, int64_t E, int64_t distinct, int64_t Din, int64_t I, DType dt) {
  ExpertSet s;
  std::vector<Tensor> pu, pd, dpu, dpd;
  for (int64_t i = 0; i < distinct; ++i) {
    pu.push_back(init_weight(rng, {I, Din}, dt));
    pd.push_back(init_weight(rng, {Din, I}, dt));
    dpu.push_back(device::to_device(pu.back(), Device::kCuda));
    dpd.push_back(device::to_device(pd.back(), Device::kCuda));
  }
  for (int64_t e = 0; e < E; ++e) {
    s.up.push_back(pu[e % distinct]);
    s.down.push_back(pd[e % distinct]);
    s.d_up.push_back(dpu[e % distinct]);
    s.d_down.push_back(dpd[e % distinct]);
  }
  return s;
}

// One call on a forced path into a poisoned device output, back as host f32.
Tensor run_path(const Tensor& x, DType dt, const Tensor& ids, const Tensor& w, const ExpertSet& s,
                cuda::moe::ExpertsPath path, const ops::KernelConfig& kernels = {}) {
  Tensor o = device::empty(Device::kCuda, dt, x.shape());
  Tensor poison = Tensor::empty(dt, x.shape());
  std::memset(poison.data(), 0xff, poison.nbytes());
  device::copy(o, poison);
  const Tensor dx = device::to_device(x, Device::kCuda, dt), dids = device::to_device(ids, Device::kCuda);
  const Tensor dw = device::to_device(w, Device::kCuda);
  cuda::moe::moe_experts_on_path(ops::Context{Device::kCuda, nullptr, nullptr, kernels}, o, dx, dids, dw, s.d_up,
                                 s.d_down, path);
  return device::to_host_f32(o);
}

// The GEMV path with the permutation as its own launch (KernelConfig::moe_gemv_fold off) instead of folded into the
// up launch (moe_kernels.h, GemvFold): the same bits.
Tensor run_path_unfolded(const Tensor& x, DType dt, const Tensor& ids, const Tensor& w, const ExpertSet& s,
                         cuda::moe::ExpertsPath path) {
  ops::KernelConfig k;
  k.moe_gemv_fold = false;
  return run_path(x, dt, ids, w, s, path, k);
}

// The decode GEMV path (grouped_gemv.cu) forced at every tile of tokens (1, 2, 4, 8 per work item, and more
// tokens per expert than a tile: several items for one expert) in bf16 and f16: against the CPU reference,
// bit-identical on a second run, and close to the tensor-core path on the same inputs.
struct GemvCase {
  int64_t E, k, Din, I;
};
void gemv_path_case(const GemvCase& c, std::initializer_list<int64_t> tokens) {
  auto rng = test::Rng::for_test();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const ExpertSet s = make_experts(rng, c.E, 4, c.Din, c.I, dt);
    for (int64_t T : tokens) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " E=" << c.E << " k=" << c.k << " Din=" << c.Din
                                        << " I=" << c.I << " T=" << T);
      Tensor ids, w;
      random_routing(rng, T, c.E, c.k, 2.5f, ids, w);
      const Tensor x = round_to(rng.normal_tensor({T, c.Din}), dt);
      const Tensor got = run_path(x, dt, ids, w, s, cuda::moe::ExpertsPath::kGemv);
      const std::vector<int64_t> rows = spread_rows(T, 8);
      EXPECT_TRUE(test::nmse_close(pick_rows(got, rows), cpu_reference_rows(x, ids, w, s.up, s.down, rows),
                                   test::kBF16ReductionNmse, test::kBF16Reduction));
      EXPECT_TRUE(test::bit_equal(run_path(x, dt, ids, w, s, cuda::moe::ExpertsPath::kGemv), got));
      EXPECT_TRUE(test::bit_equal(run_path_unfolded(x, dt, ids, w, s, cuda::moe::ExpertsPath::kGemv), got));
      EXPECT_TRUE(test::nmse_close(got, run_path(x, dt, ids, w, s, cuda::moe::ExpertsPath::kMma),
                                   test::kBF16ReductionNmse, test::kBF16Reduction));
    }
  }
}

// Both row shapes (K <= 1024: one step, 4 rows per warp; K > 1024: several steps, 2 rows per warp) with row counts
// that leave a partial last block. {72, 200}: both rows short, N = 200 and 72; {1096, 200}: up K = 1096 long with
// a tail step and N = 200 (16-row blocks), down K = 200 short and N = 1096 (32-row blocks). T = 17 and 40 are past
// the automatic cut (forced here).
TEST_P(OpsMoe, GemvPathMatchesTheCpuReference) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA GEMV path";
  gemv_path_case({8, 2, 72, 200}, {1, 2, 3, 4, 5, 8, 17, 40});
  gemv_path_case({12, 3, 1096, 200}, {1, 2, 3, 5, 8, 17, 40});
  // Super's routing width: 512 experts, top-22 (P = 176 pairs at T = 8: the folded block sort's widest case).
  gemv_path_case({512, 22, 1024, 264}, {1, 3, 8});
}

// The Nano expert sizes (Din 2688, I 1856: 336 and 232 chunks per row, neither a multiple of a step).
TEST_P(OpsMoe, GemvPathAtNanoSizes) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA GEMV path";
  gemv_path_case({16, 6, 2688, 1856}, {1, 2, 3, 5, 8, 17});
}

// Routing the router never makes but the op allows: every token of the batch on the same experts (one expert
// holds all T tokens: a full item), and a token choosing one expert twice (that expert then holds more pairs
// than T, so more than one item). At the Nano sizes and a Super-like latent size, through the automatic path.
TEST_P(OpsMoe, GemvPathSharedAndRepeatedExperts) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA GEMV path";
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t E, k, Din, I;
  };
  for (const Case c : {Case{16, 6, 2688, 1856}, Case{24, 8, 1024, 2688}}) {
    const ExpertSet s = make_experts(rng, c.E, 4, c.Din, c.I, DType::kBF16);
    for (int64_t T : {1, 3, 5, 8}) {
      for (bool repeat : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "Din=" << c.Din << " T=" << T << " repeat=" << repeat);
        Tensor ids = Tensor::empty(DType::kI32, {T, c.k}), w = Tensor::empty(DType::kF32, {T, c.k});
        for (int64_t t = 0; t < T; ++t) {
          // Choices 0 and 1: experts 5 and 2 for every token; the rest distinct random others (or, with
          // `repeat`, choice 2 repeats expert 2).
          std::vector<int32_t> pick = {5, 2};
          while (static_cast<int64_t>(pick.size()) < c.k) {
            const auto e = static_cast<int32_t>(rng.integer(0, c.E - 1));
            if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
          }
          if (repeat) pick[2] = 2;
          for (int64_t j = 0; j < c.k; ++j) {
            ids.i32()[t * c.k + j] = pick[static_cast<size_t>(j)];
            w.f32()[t * c.k + j] = rng.uniform(0.1f, 1.0f);
          }
        }
        const Tensor x = round_to(rng.normal_tensor({T, c.Din}), DType::kBF16);
        const Tensor got = run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kAuto);
        EXPECT_TRUE(test::nmse_close(got, cpu_reference_rows(x, ids, w, s.up, s.down, all_rows(T)),
                                     test::kBF16ReductionNmse, test::kBF16Reduction));
        EXPECT_TRUE(test::bit_equal(run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kAuto), got));
        EXPECT_TRUE(
            test::bit_equal(run_path_unfolded(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kAuto), got));
      }
    }
  }
}

// The down launch's early start (moe_kernels.h, GemvFold::early_routed; KernelConfig::moe_down_early): with the
// permutation folded into the up launch, the down launch's blocks whose first unit is routed rebuild the work list
// from topk_ids and issue that unit's first weight loads before their pdl_wait(). It must not change a bit: on vs off,
// and against the permutation's own launch (moe_gemv_fold off: no early start),
// over T 1, 2, 3, 8, the routing widths of Nano (128 / top-6) and Super (512 / top-22), routings with shared and
// repeated experts and with skipped ids (-1, E; a token with none valid), with and without the shared expert (whose
// units come first, so the routed units start at other blocks); and close to the CPU reference where the ids are
// valid. Then with the ids from ops::router_gate_topk on the device right before the op, as the model runs it: the
// router two launches before the down launch, the case the early read of topk_ids relies on (launch.cuh, "two
// back"); the ids are poisoned before each call, so a read before the router's write would show.
struct DownEarlyOutputs {
  Tensor out{}, shared_out{};  // host f32; shared_out empty without a shared expert
};
Tensor poisoned_device(DType dt, Shape shape) {
  Tensor t = device::empty(Device::kCuda, dt, shape);
  Tensor poison = Tensor::empty(dt, std::move(shape));
  std::memset(poison.data(), 0xff, poison.nbytes());
  device::copy(t, poison);
  return t;
}
// One GEMV-path call with the early start on or off and the permutation folded or not.
DownEarlyOutputs run_down_early(bool early, bool fold, const ops::Context& base, const Tensor& dx, const Tensor& dids,
                                const Tensor& dw, const ExpertSet& s, const Tensor* d_s_up, const Tensor* d_s_down) {
  ops::Context ctx = base;
  ctx.kernels.moe_down_early = early;
  ctx.kernels.moe_gemv_fold = fold;
  const int64_t T = dx.dim(0), D = dx.dim(1);
  Tensor o = poisoned_device(dx.dtype(), {T, D});
  DownEarlyOutputs r;
  if (d_s_up != nullptr) {
    Tensor so = poisoned_device(dx.dtype(), {T, D});
    const ops::SharedExpert shared{so, dx, *d_s_up, *d_s_down};
    cuda::moe::moe_experts_on_path(ctx, o, dx, dids, dw, s.d_up, s.d_down, cuda::moe::ExpertsPath::kGemv, &shared);
    r.shared_out = device::to_host_f32(so);
  } else {
    cuda::moe::moe_experts_on_path(ctx, o, dx, dids, dw, s.d_up, s.d_down, cuda::moe::ExpertsPath::kGemv);
  }
  r.out = device::to_host_f32(o);
  return r;
}

struct DownEarlyCase {
  int64_t E{}, k{}, Din{}, I{}, Is{};  // Is: the shared expert's intermediate size (its x is the routed experts' x)
};
constexpr DownEarlyCase kDownEarlyCases[] = {{128, 6, 2688, 1856, 3712}, {512, 22, 1024, 264, 344}};

TEST_P(OpsMoe, GemvDownEarlyStartGivesTheSameBits) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA GEMV path";
  auto rng = test::Rng::for_test();
  const DType dt = DType::kBF16;
  const ops::Context ctx{Device::kCuda, nullptr};
  for (const DownEarlyCase& c : kDownEarlyCases) {
    const ExpertSet s = make_experts(rng, c.E, 4, c.Din, c.I, dt);
    const Tensor s_up = init_weight(rng, {c.Is, c.Din}, dt), s_down = init_weight(rng, {c.Din, c.Is}, dt);
    const Tensor d_s_up = device::to_device(s_up, Device::kCuda), d_s_down = device::to_device(s_down, Device::kCuda);
    for (int64_t T : {1, 2, 3, 8}) {
      // 0 the router's choices; 1 choices 0 and 1 on experts 5 and 2 for every token (an item of all T tokens);
      // 2 as 1 with choice 2 repeating expert 2 (more pairs than T: several items for it); 3 skipped ids: -1 and E
      // in some tokens, and (T > 1) a last token with no valid id (its output row: zeros).
      for (int routing = 0; routing < 4; ++routing) {
        SCOPED_TRACE(::testing::Message() << "E=" << c.E << " k=" << c.k << " Din=" << c.Din << " I=" << c.I
                                          << " T=" << T << " routing=" << routing);
        Tensor ids, w;
        random_routing(rng, T, c.E, c.k, 2.5f, ids, w);
        for (int64_t t = 0; routing > 0 && t < T; ++t) {
          int32_t* row = ids.i32() + t * c.k;
          std::vector<int32_t> pick = {5, 2};
          while (static_cast<int64_t>(pick.size()) < c.k) {
            const auto e = static_cast<int32_t>(rng.integer(0, c.E - 1));
            if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
          }
          if (routing == 2) pick[2] = 2;
          if (routing == 3 && t % 3 == 0) pick[3] = -1;
          if (routing == 3 && t % 3 == 1) pick[1] = static_cast<int32_t>(c.E);
          if (routing == 3 && T > 1 && t == T - 1) std::fill(pick.begin(), pick.end(), -1);
          std::copy(pick.begin(), pick.end(), row);
        }
        const Tensor x = round_to(rng.normal_tensor({T, c.Din}), dt);
        const Tensor dx = device::to_device(x, Device::kCuda, dt), dids = device::to_device(ids, Device::kCuda);
        const Tensor dw = device::to_device(w, Device::kCuda);
        // The CPU reference takes valid ids only.
        const Tensor want = routing < 3 ? cpu_reference_rows(x, ids, w, s.up, s.down, all_rows(T)) : Tensor{};
        for (bool with_shared : {false, true}) {
          SCOPED_TRACE(with_shared ? "with the shared expert" : "routed experts only");
          const Tensor* su = with_shared ? &d_s_up : nullptr;
          const Tensor* sd = with_shared ? &d_s_down : nullptr;
          const DownEarlyOutputs on = run_down_early(true, true, ctx, dx, dids, dw, s, su, sd);
          const DownEarlyOutputs off = run_down_early(false, true, ctx, dx, dids, dw, s, su, sd);
          EXPECT_TRUE(test::bit_equal(on.out, off.out));
          EXPECT_TRUE(test::bit_equal(run_down_early(true, false, ctx, dx, dids, dw, s, su, sd).out, on.out));
          if (with_shared) {
            EXPECT_TRUE(test::bit_equal(on.shared_out, off.shared_out));
            Tensor want_shared = Tensor::empty(DType::kF32, {T, c.Din});
            ops::relu2_mlp(ops::Context{}, want_shared, x, s_up, s_down);
            EXPECT_TRUE(test::nmse_close(on.shared_out, want_shared, test::kBF16ReductionNmse, test::kBF16Reduction));
          }
          if (routing < 3) {
            EXPECT_TRUE(test::nmse_close(on.out, want, test::kBF16ReductionNmse, test::kBF16Reduction));
          } else if (T > 1) {  // the token without a valid id: zeros
            const float* last = on.out.f32() + (T - 1) * c.Din;
            EXPECT_TRUE(std::all_of(last, last + c.Din, [](float v) { return v == 0.0f; }));
          }
        }
      }
    }
  }
}

TEST_P(OpsMoe, GemvDownEarlyStartAfterTheDeviceRouter) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA GEMV path";
  auto rng = test::Rng::for_test();
  const DType dt = DType::kBF16;
  const device::Stream stream = device::Stream::create();
  const ops::Context step_ctx{Device::kCuda, stream.get()};
  for (const DownEarlyCase& c : kDownEarlyCases) {
    const ExpertSet s = make_experts(rng, c.E, 4, c.Din, c.I, dt);
    const Tensor s_up = init_weight(rng, {c.Is, c.Din}, dt), s_down = init_weight(rng, {c.Din, c.Is}, dt);
    const Tensor d_s_up = device::to_device(s_up, Device::kCuda), d_s_down = device::to_device(s_down, Device::kCuda);
    const Tensor gate = device::to_device(rng.normal_tensor({c.E, c.Din}, 0.05f), Device::kCuda);
    const Tensor bias = device::to_device(rng.normal_tensor({c.E}, 0.1f), Device::kCuda);
    const ops::RouterParams rp{c.k, 1, 1, true, 2.5f};
    for (int64_t T : {1, 2, 3, 8}) {
      const Tensor x = round_to(rng.normal_tensor({T, c.Din}), dt);
      const Tensor dx = device::to_device(x, Device::kCuda, dt);
      for (bool with_shared : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "E=" << c.E << " k=" << c.k << " T=" << T << " shared=" << with_shared);
        // Router, then the op on its fresh ids; both outputs and the ids poisoned first. Returns {out, shared out}.
        auto call = [&](bool early, Tensor& ids, Tensor& w) {
          ops::Context ctx = step_ctx;
          ctx.kernels.moe_down_early = early;
          Tensor dids = poisoned_device(DType::kI32, {T, c.k}), dw = poisoned_device(DType::kF32, {T, c.k});
          Tensor o = poisoned_device(dt, {T, c.Din}), so = poisoned_device(dt, {T, c.Din});
          ops::router_gate_topk(ctx, dids, dw, dx, gate, bias, rp);
          if (with_shared) {
            const ops::SharedExpert shared{so, dx, d_s_up, d_s_down};
            cuda::moe::moe_experts_on_path(ctx, o, dx, dids, dw, s.d_up, s.d_down, cuda::moe::ExpertsPath::kGemv,
                                           &shared);
          } else {
            cuda::moe::moe_experts_on_path(ctx, o, dx, dids, dw, s.d_up, s.d_down, cuda::moe::ExpertsPath::kGemv);
          }
          stream.synchronize();
          ids = device::to_host(dids);
          w = device::to_host(dw);
          return DownEarlyOutputs{device::to_host_f32(o), with_shared ? device::to_host_f32(so) : Tensor{}};
        };
        Tensor ids, w, ids_off, w_off;
        const DownEarlyOutputs on = call(true, ids, w), off = call(false, ids_off, w_off);
        ASSERT_TRUE(test::bit_equal(ids, ids_off));
        EXPECT_TRUE(test::bit_equal(on.out, off.out));
        if (with_shared) {
          EXPECT_TRUE(test::bit_equal(on.shared_out, off.shared_out));
        }
        EXPECT_TRUE(test::nmse_close(on.out, cpu_reference_rows(x, ids, w, s.up, s.down, all_rows(T)),
                                     test::kBF16ReductionNmse, test::kBF16Reduction));
      }
    }
  }
}
#ifdef CHIMERA_HAVE_CUTLASS
// The CUTLASS sm90 grouped GEMM path (ExpertsPath::kCutlass, cmake -DCHIMERA_CUTLASS=ON): against the CPU reference,
// bit-identical on a second run, and close to the mma path on the same inputs (both fp32 accumulation with h rounded
// to bf16; the summation order inside the tensor-core instructions may differ, so not bit-equal). Routing widths of
// Nano (128 / top-6) and Super (512 / top-22); sizes with M tails against the 128-row weight tile (200, 344, 1856)
// and K tails against the 64-wide k step (72, 200, 344); token counts that leave partial 64-token tiles.
struct CutlassCase {
  int64_t E, k, Din, I;
};
// The CUTLASS path with its token tile forced (KernelConfig::moe_cutlass_tile_n: 64 or 128; 0 automatic).
Tensor run_cutlass_tile(int tile_n, const Tensor& x, const Tensor& ids, const Tensor& w, const ExpertSet& s) {
  ops::KernelConfig k;
  k.moe_cutlass_tile_n = tile_n;
  return run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kCutlass, k);
}
void cutlass_path_case(const CutlassCase& c, std::initializer_list<int64_t> tokens) {
  auto rng = test::Rng::for_test();
  const ExpertSet s = make_experts(rng, c.E, 4, c.Din, c.I, DType::kBF16);
  for (int64_t T : tokens) {
    SCOPED_TRACE(::testing::Message() << "E=" << c.E << " k=" << c.k << " Din=" << c.Din << " I=" << c.I << " T=" << T);
    Tensor ids, w;
    random_routing(rng, T, c.E, c.k, 2.5f, ids, w);
    const Tensor x = round_to(rng.normal_tensor({T, c.Din}), DType::kBF16);
    const Tensor got = run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kCutlass);
    const std::vector<int64_t> rows = spread_rows(T, 12);
    EXPECT_TRUE(test::nmse_close(pick_rows(got, rows), cpu_reference_rows(x, ids, w, s.up, s.down, rows),
                                 test::kBF16ReductionNmse, test::kBF16Reduction));
    EXPECT_TRUE(test::bit_equal(run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kCutlass), got));
    const Tensor mma = run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kMma);
    EXPECT_TRUE(test::nmse_close(got, mma, test::kBF16ReductionNmse, test::kBF16Reduction));
    // Both token tiles, whichever the automatic choice took.
    const Tensor n64 = run_cutlass_tile(64, x, ids, w, s), n128 = run_cutlass_tile(128, x, ids, w, s);
    EXPECT_TRUE(test::nmse_close(n64, mma, test::kBF16ReductionNmse, test::kBF16Reduction));
    EXPECT_TRUE(test::nmse_close(n128, mma, test::kBF16ReductionNmse, test::kBF16Reduction));
    auto differ = [&](const Tensor& a, const Tensor& b) {
      int64_t n = 0;
      for (int64_t i = 0; i < a.numel(); ++i) n += a.f32()[i] != b.f32()[i] ? 1 : 0;
      return static_cast<long long>(n);
    };
    std::printf(
        "[ INFO     ] cutlass E=%lld k=%lld Din=%lld I=%lld T=%lld: outputs differing from mma %lld, "
        "n64 vs n128 %lld, of %lld\n",
        static_cast<long long>(c.E), static_cast<long long>(c.k), static_cast<long long>(c.Din),
        static_cast<long long>(c.I), static_cast<long long>(T), differ(got, mma), differ(n64, n128),
        static_cast<long long>(got.numel()));
  }
}

TEST_P(OpsMoe, CutlassPathMatchesTheCpuReferenceAndTheMmaPath) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA CUTLASS path";
  cutlass_path_case({128, 6, 200, 344}, {1, 17, 111, 989});
  cutlass_path_case({512, 22, 344, 72}, {17, 111, 989});
  cutlass_path_case({8, 2, 72, 200}, {3, 111, 4099});  // few experts: hundreds of rows per expert (several N tiles)
}

TEST_P(OpsMoe, CutlassPathAtModelSizes) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA CUTLASS path";
  cutlass_path_case({128, 6, 2688, 1856}, {17, 111, 989});  // Nano
  cutlass_path_case({512, 22, 1024, 2688}, {17, 111});      // Super's latent MoE
}

// kAuto's prefill choice: CUTLASS from kCutlassMinTokens bf16 tokens (the same bits as the forced path), the mma
// kernels below it and when turned off (KernelConfig::moe_cutlass).
TEST_P(OpsMoe, AutoTakesCutlassFromItsTokenThreshold) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA CUTLASS path";
  auto rng = test::Rng::for_test();
  const int64_t E = 64, k = 6, Din = 264, I = 200;
  const ExpertSet s = make_experts(rng, E, 4, Din, I, DType::kBF16);
  for (int64_t T : {cuda::moe::kCutlassMinTokens - 1, cuda::moe::kCutlassMinTokens}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    Tensor ids, w;
    random_routing(rng, T, E, k, 2.5f, ids, w);
    const Tensor x = round_to(rng.normal_tensor({T, Din}), DType::kBF16);
    const Tensor got = run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kAuto);
    const bool above = T >= cuda::moe::kCutlassMinTokens;
    const auto expected = above ? cuda::moe::ExpertsPath::kCutlass : cuda::moe::ExpertsPath::kMma;
    EXPECT_TRUE(test::bit_equal(got, run_path(x, DType::kBF16, ids, w, s, expected)));
    ops::KernelConfig no_cutlass;
    no_cutlass.moe_cutlass = false;
    EXPECT_TRUE(test::bit_equal(run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kAuto, no_cutlass),
                                run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kMma)));
  }
}

// Every token on the same experts (one group holds all T rows) and a token choosing one expert twice (a group with
// more rows than tokens), plus ids outside [0, E) (skipped pairs: fewer rows than P).
TEST_P(OpsMoe, CutlassPathSharedRepeatedAndSkippedExperts) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA CUTLASS path";
  auto rng = test::Rng::for_test();
  const int64_t E = 16, k = 6, Din = 264, I = 200;
  const ExpertSet s = make_experts(rng, E, 4, Din, I, DType::kBF16);
  for (int64_t T : {5, 130}) {
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " mode=" << mode);
      Tensor ids = Tensor::empty(DType::kI32, {T, k}), w = Tensor::empty(DType::kF32, {T, k});
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int32_t> pick = {5, 2};
        while (static_cast<int64_t>(pick.size()) < k) {
          const auto e = static_cast<int32_t>(rng.integer(0, E - 1));
          if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
        }
        if (mode == 1) pick[2] = 2;
        if (mode == 2 && t % 3 == 0) pick[3] = -1;
        for (int64_t j = 0; j < k; ++j) {
          ids.i32()[t * k + j] = pick[static_cast<size_t>(j)];
          w.f32()[t * k + j] = rng.uniform(0.1f, 1.0f);
        }
      }
      const Tensor x = round_to(rng.normal_tensor({T, Din}), DType::kBF16);
      const Tensor got = run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kCutlass);
      EXPECT_TRUE(test::nmse_close(got, run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kMma),
                                   test::kBF16ReductionNmse, test::kBF16Reduction));
      if (mode < 2) {  // the CPU reference takes valid ids only
        EXPECT_TRUE(test::nmse_close(got, cpu_reference_rows(x, ids, w, s.up, s.down, all_rows(T)),
                                     test::kBF16ReductionNmse, test::kBF16Reduction));
      }
    }
  }
}

// The path captured in a CUDA graph (no host synchronisation: the group shapes are written on the device) and
// replayed on new routings and inputs copied into the captured buffers: the same bits as eager calls.
TEST_P(OpsMoe, CutlassPathReplaysInACudaGraph) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA CUTLASS path";
  auto rng = test::Rng::for_test();
  const int64_t E = 128, k = 6, Din = 264, I = 200, T = 300;
  const ExpertSet s = make_experts(rng, E, 4, Din, I, DType::kBF16);
  const device::Stream stream = device::Stream::create();
  const ops::Context ctx{Device::kCuda, stream.get()};
  const Tensor dx = device::empty(Device::kCuda, DType::kBF16, {T, Din});
  const Tensor dids = device::empty(Device::kCuda, DType::kI32, {T, k});
  const Tensor dw = device::empty(Device::kCuda, DType::kF32, {T, k});
  const Tensor dout = device::empty(Device::kCuda, DType::kBF16, {T, Din});
  auto load = [&](const Tensor& x, const Tensor& ids, const Tensor& w) {
    device::copy(dx, test::cast_to(x, DType::kBF16));
    device::copy(dids, ids);
    device::copy(dw, w);
  };
  auto call = [&] {
    cuda::moe::moe_experts_on_path(ctx, dout, dx, dids, dw, s.d_up, s.d_down, cuda::moe::ExpertsPath::kCutlass);
  };
  Tensor ids, w;
  random_routing(rng, T, E, k, 2.5f, ids, w);
  load(round_to(rng.normal_tensor({T, Din}), DType::kBF16), ids, w);
  call();  // outside the capture first: the pointer tables are uploaded on a first call
  stream.synchronize();
  device::AllocPool pool;
  device::Graph graph;
  {
    const device::ScopedAllocPool scope(pool);
    graph = device::Graph::capture(ctx.stream, call);
  }
  ASSERT_TRUE(static_cast<bool>(graph));
  for (int rep = 0; rep < 3; ++rep) {
    SCOPED_TRACE(::testing::Message() << "replay " << rep);
    random_routing(rng, T, E, k, 2.5f, ids, w);
    const Tensor x = round_to(rng.normal_tensor({T, Din}), DType::kBF16);
    load(x, ids, w);
    graph.launch(ctx.stream);
    stream.synchronize();
    const Tensor replayed = device::to_host_f32(dout);
    EXPECT_TRUE(test::bit_equal(replayed, run_path(x, DType::kBF16, ids, w, s, cuda::moe::ExpertsPath::kCutlass)));
  }
}
#endif  // CHIMERA_HAVE_CUTLASS
#endif

// ops::moe_experts_shared: the routed experts and the layer's shared expert in one op. Reference: the CPU
// moe_experts and relu2_mlp on the same rounded inputs. On the CPU the op must be exactly those two ops (bit-equal);
// on CUDA at T <= 8 with 16-bit activations the shared expert runs inside the GEMV launches, so additionally: the
// routed output is bit-equal to ops::moe_experts alone (the shared units do not disturb the routed ones) and the
// shared output is close to ops::relu2_mlp on the device. Cases: a plain MoE (shared x = x) and a latent one (the
// routed experts on a latent of another width, the shared expert on the hidden state), awkward sizes (K tails,
// N not a multiple of the 16-row units), T 1..8 plus 11 (past the GEMV cut: the two ops one after the other), and
// routings with every token on the same experts (and a token choosing one expert twice).
struct SharedCase {
  int64_t E, k, Din, H, I, Is;  // Din == H: no latent space
  bool cuda_only;
};
TEST_P(OpsMoe, ExpertsWithSharedExpertMatchTheTwoOps) {
  auto rng = test::Rng::for_test();
  const std::vector<DType> dtypes =
      on_cuda() ? std::vector<DType>{DType::kBF16, DType::kF16, DType::kF32} : std::vector<DType>{DType::kF32};
  for (const SharedCase c : {SharedCase{12, 3, 200, 200, 72, 136, false}, SharedCase{10, 4, 64, 1096, 200, 344, false},
                             SharedCase{8, 6, 2688, 2688, 1856, 3712, true}}) {
    if (c.cuda_only && !on_cuda()) continue;
    for (DType dt : dtypes) {
      // Weights in the activation dtype on CUDA (the GEMV domain; F32 with F32 for cuBLASLt's relu2_mlp), BF16 on
      // the CPU (the checkpoint's dtype).
      const DType wt = on_cuda() ? dt : DType::kBF16;
      std::vector<Tensor> up, down, d_up, d_down;
      for (int64_t e = 0; e < c.E; ++e) {
        up.push_back(init_weight(rng, {c.I, c.Din}, wt));
        down.push_back(init_weight(rng, {c.Din, c.I}, wt));
        d_up.push_back(in(up.back()));
        d_down.push_back(in(down.back()));
      }
      const Tensor s_up = init_weight(rng, {c.Is, c.H}, wt), s_down = init_weight(rng, {c.H, c.Is}, wt);
      const Tensor d_s_up = in(s_up), d_s_down = in(s_down);
      for (int64_t T : {1, 2, 3, 4, 5, 7, 8, 11}) {
        for (int routing = 0; routing < 3; ++routing) {  // 0 random, 1 all tokens on experts 5 and 2, 2 a repeat
          if (routing > 0 && T != 3 && T != 8) continue;
          SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " E=" << c.E << " Din=" << c.Din << " H=" << c.H
                                            << " I=" << c.I << " Is=" << c.Is << " T=" << T << " routing=" << routing);
          Tensor ids, w;
          random_routing(rng, T, c.E, c.k, 2.5f, ids, w);
          for (int64_t t = 0; routing > 0 && t < T; ++t) {
            int32_t* row = ids.i32() + t * c.k;
            // Choices 0 and 1 become experts 5 and 2 (swapped into place, so the others stay distinct).
            for (int32_t want : {5, 2}) {
              const int64_t j = want == 5 ? 0 : 1;
              int32_t* hit = std::find(row, row + c.k, want);
              if (hit != row + c.k) std::swap(*hit, row[j]);
              row[j] = want;
            }
            if (routing == 2) row[2] = 2;  // expert 2 twice for this token
          }
          const Tensor x = round_to(rng.normal_tensor({T, c.Din}), dt);
          const Tensor xh = c.Din == c.H ? x : round_to(rng.normal_tensor({T, c.H}), dt);
          const Tensor dx = in(x, dt), dxh = c.Din == c.H ? dx : in(xh, dt);
          Tensor o = out(dt, {T, c.Din}), so = out(dt, {T, c.H});
          const Tensor dids = in(ids), dw = in(w);
          ops::moe_experts_shared(ctx(), o, dx, dids, dw, d_up, d_down, ops::SharedExpert{so, dxh, d_s_up, d_s_down});
          const Tensor got = host_f32(o), got_shared = host_f32(so);

          // The two ops on this backend.
          Tensor o2 = out(dt, {T, c.Din}), so2 = out(dt, {T, c.H});
          ops::moe_experts(ctx(), o2, dx, dids, dw, d_up, d_down);
          ops::relu2_mlp(ctx(), so2, dxh, d_s_up, d_s_down);
          EXPECT_TRUE(test::bit_equal(got, host_f32(o2)));
          if (!on_cuda()) {
            EXPECT_TRUE(test::bit_equal(got_shared, host_f32(so2)));
            continue;
          }
          EXPECT_TRUE(test::nmse_close(got_shared, host_f32(so2), nmse_for(dt), tolerance_for(dt)));
          // Against the CPU reference.
          Tensor want = Tensor::empty(DType::kF32, {T, c.Din}), want_shared = Tensor::empty(DType::kF32, {T, c.H});
          ops::moe_experts(ops::Context{}, want, x, ids, w, up, down);
          ops::relu2_mlp(ops::Context{}, want_shared, xh, s_up, s_down);
          EXPECT_TRUE(test::nmse_close(got, want, nmse_for(dt), tolerance_for(dt)));
          EXPECT_TRUE(test::nmse_close(got_shared, want_shared, nmse_for(dt), tolerance_for(dt)));
          // Deterministic: a second call gives the same bits.
          Tensor so3 = out(dt, {T, c.H});
          ops::moe_experts_shared(ctx(), o2, dx, dids, dw, d_up, d_down, ops::SharedExpert{so3, dxh, d_s_up, d_s_down});
          EXPECT_TRUE(test::bit_equal(host_f32(so3), got_shared));
#ifdef CHIMERA_HAVE_CUDA
          // The shared units after the up launch's pdl_wait() instead of before it (moe_early_shared off): the
          // same bits for both outputs.
          {
            ops::Context late = ctx();
            late.kernels.moe_early_shared = false;
            Tensor o4 = out(dt, {T, c.Din}), so4 = out(dt, {T, c.H});
            ops::moe_experts_shared(late, o4, dx, dids, dw, d_up, d_down,
                                    ops::SharedExpert{so4, dxh, d_s_up, d_s_down});
            EXPECT_TRUE(test::bit_equal(host_f32(o4), got));
            EXPECT_TRUE(test::bit_equal(host_f32(so4), got_shared));
          }
#endif
        }
      }
    }
  }
}

TEST_P(OpsMoe, SharedExpertMismatchThrowsNamingTheOp) {
  const Tensor x = in(Tensor::zeros(DType::kF32, {2, 8}));
  Tensor o = out(DType::kF32, {2, 8}), so = out(DType::kF32, {2, 8});
  const std::vector<Tensor> up = {in(Tensor::zeros(DType::kBF16, {4, 8}))};
  const std::vector<Tensor> down = {in(Tensor::zeros(DType::kBF16, {8, 4}))};
  const Tensor ids = in(Tensor::from_i32({2, 1}, std::vector<int32_t>{0, 0}));
  const Tensor w = in(Tensor::zeros(DType::kF32, {2, 1}));
  const Tensor s_up = in(Tensor::zeros(DType::kBF16, {6, 8})), s_down_bad = in(Tensor::zeros(DType::kBF16, {8, 5}));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::moe_experts_shared(ctx(), o, x, ids, w, up, down, ops::SharedExpert{so, x, s_up, s_down_bad}); },
      ErrorKind::kRuntime, "ops::moe_experts_shared: down_proj BF16[8, 5] does not match up_proj BF16[6, 8]"));
  const Tensor x3 = in(Tensor::zeros(DType::kF32, {3, 8}));
  Tensor so3 = out(DType::kF32, {3, 8});
  const Tensor s_down = in(Tensor::zeros(DType::kBF16, {8, 6}));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::moe_experts_shared(ctx(), o, x, ids, w, up, down, ops::SharedExpert{so3, x3, s_up, s_down}); },
      ErrorKind::kRuntime, "ops::moe_experts_shared: shared.x F32[3, 8] does not match x F32[2, 8]"));
}

TEST_P(OpsMoe, BadExpertsThrowNamingTheOp) {
  const Tensor x = in(Tensor::zeros(DType::kF32, {2, 8}));
  Tensor o = out(DType::kF32, {2, 8});
  const std::vector<Tensor> up = {in(Tensor::zeros(DType::kBF16, {4, 8})), in(Tensor::zeros(DType::kBF16, {4, 8}))};
  const std::vector<Tensor> down = {in(Tensor::zeros(DType::kBF16, {8, 4})), in(Tensor::zeros(DType::kBF16, {8, 5}))};
  const Tensor ids = in(Tensor::from_i32({2, 1}, std::vector<int32_t>{0, 1}));
  const Tensor w = in(Tensor::zeros(DType::kF32, {2, 1}));
  EXPECT_TRUE(test::throws_error([&] { ops::moe_experts(ctx(), o, x, ids, w, up, down); }, ErrorKind::kRuntime,
                                 "ops::moe_experts: down_proj[1] BF16[8, 5] does not match up_proj[1] BF16[4, 8]"));
  // Expert ids are range-checked on the host only (a device check would need a synchronisation; the CUDA
  // kernels skip out-of-range ids).
  if (on_cuda()) return;
  const std::vector<Tensor> down_ok = {down[0], down[0]};
  const Tensor bad_ids = Tensor::from_i32({2, 1}, std::vector<int32_t>{0, 2});
  EXPECT_TRUE(test::throws_error([&] { ops::moe_experts(ctx(), o, x, bad_ids, w, up, down_ok); }, ErrorKind::kRuntime,
                                 "ops::moe_experts: topk_ids[1] = 2 is out of range for 2 experts"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsMoe);

}  // namespace
}  // namespace chimera
