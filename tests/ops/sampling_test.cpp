// ops::sample_tokens on every backend against the CPU reference (the algorithm runtime's sample_token uses):
// greedy and top_k = 1 bit-equal, seeded draws equal in >= 99% of cases, empirical frequencies right.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"

namespace chimera {
namespace {

using test::BackendTest;

class OpsSampling : public BackendTest {
 protected:
  // Token ids chosen by the backend under test and by the CPU reference for the same logits and rows.
  std::pair<std::vector<int32_t>, std::vector<int32_t>> both(const Tensor& logits,
                                                             const std::vector<ops::SamplingRow>& rows) {
    const int64_t R = logits.dim(0);
    Tensor ids = output(DType::kI32, {R});
    ops::sample_tokens(ctx(), ids, on_backend(logits), rows);
    const Tensor got = device::to_host(ids);
    Tensor ref = Tensor::empty(DType::kI32, {R});
    ops::sample_tokens(ops::Context{}, ref, logits, rows);
    return {std::vector<int32_t>(got.i32(), got.i32() + R), std::vector<int32_t>(ref.i32(), ref.i32() + R)};
  }
};

// Random logits with planted ties at the maximum (the lowest id must win) in some rows.
Tensor tied_logits(test::Rng& rng, int64_t R, int64_t V) {
  Tensor l = rng.normal_tensor({R, V}, 3.0f);
  for (int64_t r = 0; r < R; r += 2) {
    float* row = l.f32() + r * V;
    const float mx = *std::max_element(row, row + V) + 1.0f;
    row[rng.integer(0, V - 1)] = mx;
    row[rng.integer(0, V - 1)] = mx;
  }
  return l;
}

TEST_P(OpsSampling, GreedyAndTopKOneAreTheArgmax) {
  auto rng = test::Rng::for_test();
  for (int64_t V : {1, 3, 4099, 131072}) {
    SCOPED_TRACE(::testing::Message() << "V=" << V);
    const int64_t R = 64;
    const Tensor logits = tied_logits(rng, R, V);
    std::vector<ops::SamplingRow> rows(R);
    for (int64_t r = 0; r < R; ++r) {
      if (r % 2 == 1) rows[r] = ops::SamplingRow{0.7f, 1, 0.9f, uint64_t(r), uint64_t(r)};  // top_k 1: greedy
    }
    const auto [got, want] = both(logits, rows);
    EXPECT_EQ(got, want);
    for (int64_t r = 0; r < R; ++r) {
      const float* row = logits.f32() + r * V;
      ASSERT_EQ(want[r], std::max_element(row, row + V) - row);
    }
  }
}

// Greedy with few rows: the CUDA path splits each row over many blocks (sampling.cu, greedy_split_kernel), so
// planted maxima sit in different blocks' chunks and the lowest id must still win; NaN, -0 / +0 and -inf rows
// follow std::max_element (a NaN at id 0 wins, a NaN elsewhere never does; -0 ties +0). Both the vectorised
// (V % 4 == 0) and the scalar layout, and row counts on both sides of the split path's 64-row limit.
TEST_P(OpsSampling, GreedyFewRowsMatchMaxElement) {
  auto rng = test::Rng::for_test();
  const float kNan = std::nanf("");
  const float kInf = std::numeric_limits<float>::infinity();
  for (int64_t R : {1, 2, 3, 7, 64, 65}) {
    for (int64_t V : {2, 1025, 4099, 100003, 131071, 131072, 262148}) {
      if (R > 7 && V > 4099 && V != 131072) continue;  // keep the CPU side short
      SCOPED_TRACE(::testing::Message() << "R=" << R << " V=" << V);
      Tensor logits = rng.normal_tensor({R, V}, 3.0f);
      for (int64_t r = 0; r < R; ++r) {
        float* row = logits.f32() + r * V;
        const float mx = *std::max_element(row, row + V) + 1.0f;
        const int64_t a = rng.integer(0, V - 1), b = rng.integer(0, V - 1);
        switch ((r + V) % 6) {
          case 0:  // two equal maxima, usually in different chunks
            row[a] = mx;
            row[b] = mx;
            break;
          case 1:  // NaN at id 0 wins
            row[0] = kNan;
            row[a] = mx;
            break;
          case 2:  // NaNs elsewhere never win, not even over the maximum's id
            row[a] = mx;
            row[b] = kNan;
            row[V - 1] = kNan;
            if (a != 0) row[a - 1] = kNan;
            break;
          case 3:  // every logit -inf but one -0 and one +0: the lower id of the two
            std::fill(row, row + V, -kInf);
            row[a] = -0.0f;
            row[b] = 0.0f;
            break;
          case 4:  // all -inf: id 0
            std::fill(row, row + V, -kInf);
            break;
          default:  // the maximum at the very end
            row[V - 1] = mx;
            break;
        }
      }
      std::vector<ops::SamplingRow> rows(R);
      for (int64_t r = 0; r < R; r += 3) rows[r] = ops::SamplingRow{0.9f, 1, 1.0f, 1, 2};  // top_k 1: greedy
      const auto [got, want] = both(logits, rows);
      EXPECT_EQ(got, want);
      for (int64_t r = 0; r < R; ++r) {
        const float* row = logits.f32() + r * V;
        ASSERT_EQ(want[r], std::max_element(row, row + V) - row) << "row " << r;
      }
    }
  }
}

// One sampled row among greedy ones keeps the whole batch on the one-block-per-row kernel; greedy rows there
// must agree with the split path's answers for the same logits.
TEST_P(OpsSampling, GreedyRowsBesideASampledRow) {
  auto rng = test::Rng::for_test();
  const int64_t R = 5, V = 40961;
  const Tensor logits = tied_logits(rng, R, V);
  std::vector<ops::SamplingRow> rows(R);
  const auto [greedy_only, want] = both(logits, rows);
  rows[2] = ops::SamplingRow{1.0f, 0, 1.0f, 11, 3};
  const auto [mixed, mixed_want] = both(logits, rows);
  EXPECT_EQ(greedy_only, want);
  EXPECT_EQ(mixed, mixed_want);
  for (int64_t r = 0; r < R; ++r) {
    if (r != 2) {
      EXPECT_EQ(mixed[r], greedy_only[r]) << "row " << r;
    }
  }
}

// 1,000 seeded draws over awkward vocabularies and every combination of temperature / top-k / top-p; then
// a full 131072-token vocabulary.
TEST_P(OpsSampling, SeededDrawsMatchTheCpu) {
  auto rng = test::Rng::for_test();
  const ops::SamplingRow configs[] = {{1.0f, 0, 1.0f, 0, 0},  {0.7f, 50, 1.0f, 0, 0},   {1.3f, 0, 0.9f, 0, 0},
                                      {0.8f, 40, 0.8f, 0, 0}, {2.0f, 4099, 0.5f, 0, 0}, {0.5f, 3, 1.0f, 0, 0}};
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1000, 4099}, {1000, 111}};
  if (on_cuda()) shapes.emplace_back(32, 131072);  // the CPU instance would only compare the CPU with itself
  for (auto [R, V] : shapes) {
    SCOPED_TRACE(::testing::Message() << "R=" << R << " V=" << V);
    const Tensor logits = tied_logits(rng, R, V);
    std::vector<ops::SamplingRow> rows(R);
    for (int64_t r = 0; r < R; ++r) {
      rows[r] = configs[r % std::size(configs)];
      rows[r].seed = 1234 + uint64_t(r) * 7;
      rows[r].step = uint64_t(r);
    }
    const auto [got, want] = both(logits, rows);
    int64_t equal = 0;
    for (int64_t r = 0; r < R; ++r) equal += got[r] == want[r];
    EXPECT_GE(double(equal), 0.99 * double(R)) << equal << " of " << R << " draws equal to the CPU's";
  }
}

// Many equal logits: the order among ties (lower id first) decides which token a uniform maps to.
TEST_P(OpsSampling, TiesAreOrderedById) {
  const int64_t R = 1000, V = 300;
  Tensor logits = Tensor::empty(DType::kF32, {R, V});
  for (int64_t i = 0; i < R * V; ++i) logits.f32()[i] = float((i * 7) % 5) - 2.0f;  // 5 distinct values
  std::vector<ops::SamplingRow> rows(R);
  for (int64_t r = 0; r < R; ++r)
    rows[r] = ops::SamplingRow{1.0f, r % 3 == 0 ? 77 : 0, r % 2 ? 0.5f : 1.0f, 99, uint64_t(r)};
  const auto [got, want] = both(logits, rows);
  int64_t equal = 0;
  for (int64_t r = 0; r < R; ++r) equal += got[r] == want[r];
  EXPECT_GE(double(equal), 0.99 * double(R)) << equal << " of " << R;
}

TEST_P(OpsSampling, FrequenciesFollowTheSoftmax) {
  const int64_t R = 20000;
  const float probs[] = {0.4f, 0.3f, 0.2f, 0.1f};
  Tensor logits = Tensor::empty(DType::kF32, {R, 4});
  for (int64_t r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) logits.f32()[r * 4 + j] = std::log(probs[j]);
  }
  auto draw = [&](int32_t top_k, float top_p) {
    std::vector<ops::SamplingRow> rows(R);
    for (int64_t r = 0; r < R; ++r) rows[r] = ops::SamplingRow{1.0f, top_k, top_p, 5, uint64_t(r)};
    Tensor ids = output(DType::kI32, {R});
    ops::sample_tokens(ctx(), ids, on_backend(logits), rows);
    const Tensor h = device::to_host(ids);
    std::map<int32_t, double> f;
    for (int64_t r = 0; r < R; ++r) f[h.i32()[r]] += 1.0 / double(R);
    return f;
  };
  auto f = draw(0, 1.0f);
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(f[j], probs[j], 0.015) << "token " << j;
  f = draw(2, 1.0f);  // top-k 2: renormalised over {0, 1}
  EXPECT_NEAR(f[0], 0.4 / 0.7, 0.015);
  EXPECT_EQ(f.count(2) + f.count(3), 0u);
  f = draw(0, 0.85f);  // 0.4 + 0.3 + 0.2 >= 0.85: token 3 never drawn
  EXPECT_NEAR(f[2], 0.2 / 0.9, 0.015);
  EXPECT_EQ(f.count(3), 0u);
}

TEST_P(OpsSampling, RejectsBadParameters) {
  const Tensor logits = on_backend(Tensor::zeros(DType::kF32, {2, 8}));
  Tensor ids = output(DType::kI32, {2});
  std::vector<ops::SamplingRow> rows(2);
  rows[1].temperature = -1.0f;
  EXPECT_TRUE(test::throws_error([&] { ops::sample_tokens(ctx(), ids, logits, rows); }, ErrorKind::kRuntime,
                                 "ops::sample_tokens: row 1: temperature -1 must be a finite number >= 0"));
  rows[1] = ops::SamplingRow{1.0f, 0, 0.0f, 0, 0};
  EXPECT_TRUE(test::throws_error([&] { ops::sample_tokens(ctx(), ids, logits, rows); }, ErrorKind::kRuntime,
                                 "ops::sample_tokens: row 1: top_p 0 must be in (0, 1]"));
  rows.pop_back();
  EXPECT_TRUE(test::throws_error([&] { ops::sample_tokens(ctx(), ids, logits, rows); }, ErrorKind::kRuntime,
                                 "ops::sample_tokens: 1 sampling rows for logits F32[2, 8]"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsSampling);

}  // namespace
}  // namespace chimera
