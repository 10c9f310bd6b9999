// Router (noaux_tc sigmoid top-k) and routed experts against naive per-token loops.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"

namespace chimera {
namespace {

using test::BackendTest;

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

class OpsRouter : public BackendTest {
 protected:
  void route(const Tensor& logits, const Tensor& bias, const ops::RouterParams& p, Tensor& ids, Tensor& w) {
    ids = Tensor::empty(DType::kI32, {logits.dim(0), p.top_k});
    w = Tensor::empty(DType::kF32, {logits.dim(0), p.top_k});
    test::poison(ids);
    test::poison(w);
    ops::router_topk(ctx(), ids, w, logits, bias, p);
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
  const Tensor logits = Tensor::zeros(DType::kF32, {2, 12}), bias = Tensor::zeros(DType::kF32, {12});
  Tensor ids = Tensor::empty(DType::kI32, {2, 4}), w = Tensor::empty(DType::kF32, {2, 4});
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

CHIMERA_INSTANTIATE_BACKENDS(OpsRouter);

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

class OpsMoe : public BackendTest {};

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
      const Tensor logits = rng.normal_tensor({T, E}), bias = rng.normal_tensor({E}, 0.1f);
      Tensor ids = Tensor::empty(DType::kI32, {T, k}), w = Tensor::empty(DType::kF32, {T, k});
      ops::router_topk(ctx(), ids, w, logits, bias, {k, 1, 1, true, 2.5f});
      const Tensor x = rng.normal_tensor({T, Din});
      Tensor out = Tensor::empty(DType::kF32, {T, Din});
      test::poison(out);
      ops::moe_experts(ctx(), out, x, ids, w, up, down);
      EXPECT_TRUE(
          test::nmse_close(out, naive_experts(x, ids, w, up, down), test::kF32ReductionNmse, test::kF32Reduction));
    }
  }
}

TEST_P(OpsMoe, BadExpertsThrowNamingTheOp) {
  const Tensor x = Tensor::zeros(DType::kF32, {2, 8});
  Tensor out = Tensor::empty(DType::kF32, {2, 8});
  const std::vector<Tensor> up = {Tensor::zeros(DType::kBF16, {4, 8}), Tensor::zeros(DType::kBF16, {4, 8})};
  const std::vector<Tensor> down = {Tensor::zeros(DType::kBF16, {8, 4}), Tensor::zeros(DType::kBF16, {8, 5})};
  const Tensor ids = Tensor::from_i32({2, 1}, std::vector<int32_t>{0, 1}), w = Tensor::zeros(DType::kF32, {2, 1});
  EXPECT_TRUE(test::throws_error([&] { ops::moe_experts(ctx(), out, x, ids, w, up, down); }, ErrorKind::kRuntime,
                                 "ops::moe_experts: down_proj[1] BF16[8, 5] does not match up_proj[1] BF16[4, 8]"));
  const std::vector<Tensor> down_ok = {down[0], down[0]};
  const Tensor bad_ids = Tensor::from_i32({2, 1}, std::vector<int32_t>{0, 2});
  EXPECT_TRUE(test::throws_error([&] { ops::moe_experts(ctx(), out, x, bad_ids, w, up, down_ok); }, ErrorKind::kRuntime,
                                 "ops::moe_experts: topk_ids[1] = 2 is out of range for 2 experts"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsMoe);

}  // namespace
}  // namespace chimera
