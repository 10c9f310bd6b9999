// ops::sample_tokens on every backend against the CPU reference (the algorithm runtime's sample_token uses):
// greedy and top_k = 1 bit-equal, seeded draws equal in >= 99% of cases, empirical frequencies right.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
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

// The full sampler's outputs on the backend under test and on the CPU reference.
struct FullOut {
  std::vector<int32_t> ids, nonfinite, top_ids;
  std::vector<float> logprobs, top_logprobs;
};
FullOut full_outputs(const ops::Context& ctx, const Tensor& logits_host, const std::vector<ops::SamplingRow>& rows,
                     const std::vector<ops::PenaltyToken>& pen, int64_t K) {
  const int64_t R = logits_host.dim(0);
  const Device d = ctx.device;
  ops::SamplingOutputs out;
  out.ids = device::empty(d, DType::kI32, {R});
  out.logprobs = device::empty(d, DType::kF32, {R});
  out.nonfinite = device::empty(d, DType::kI32, {R});
  if (K > 0) {
    out.top_ids = device::empty(d, DType::kI32, {R, K});
    out.top_logprobs = device::empty(d, DType::kF32, {R, K});
  }
  ops::sample_tokens(ctx, out, device::to_device(logits_host, d), rows, pen);
  FullOut f;
  auto i32 = [](const Tensor& t) {
    const Tensor h = device::to_host(t);
    return std::vector<int32_t>(h.i32(), h.i32() + h.numel());
  };
  auto f32 = [](const Tensor& t) {
    const Tensor h = device::to_host(t);
    return std::vector<float>(h.f32(), h.f32() + h.numel());
  };
  f.ids = i32(out.ids);
  f.nonfinite = i32(out.nonfinite);
  f.logprobs = f32(out.logprobs);
  if (K > 0) {
    f.top_ids = i32(out.top_ids);
    f.top_logprobs = f32(out.top_logprobs);
  }
  return f;
}

// Every parameter together (penalties, min_p, top-k / top-p, logprobs, top logprobs, non-finite rows) on awkward
// vocabulary and batch sizes: the backend against the CPU reference, and the reference against definitions
// (log-softmax in double, the top tokens by a full sort, the flag by a scan). Greedy rows must agree exactly;
// drawn rows in >= 98% of cases (a uniform within rounding of a CDF boundary may pick a neighbour).
TEST_P(OpsSampling, AllParametersMatchTheCpuOnAwkwardShapes) {
  auto rng = test::Rng::for_test();
  const int64_t K = 6;
  for (int64_t V : {1, 7, 4099, 131072}) {
    for (int64_t R : {1, 3, 70}) {
      if (!on_cuda() && V == 131072 && R > 3) continue;  // keep the CPU instance short
      SCOPED_TRACE(::testing::Message() << "R=" << R << " V=" << V);
      Tensor logits = tied_logits(rng, R, V);
      std::vector<ops::SamplingRow> rows(R);
      std::vector<ops::PenaltyToken> pen;
      for (int64_t r = 0; r < R; ++r) {
        ops::SamplingRow& row = rows[r];
        const int kind = static_cast<int>(r % 5);
        row.temperature = kind == 0 ? 0.0f : 0.5f + 0.25f * static_cast<float>(kind);
        row.top_k = kind == 2 ? 20 : 0;
        row.top_p = kind == 3 ? 0.8f : 1.0f;
        row.min_p = kind == 4 ? 0.1f : (kind == 1 ? 0.02f : 0.0f);
        row.seed = 77 + static_cast<uint64_t>(r);
        row.step = static_cast<uint64_t>(r) * 3;
        row.num_top_logprobs = static_cast<int32_t>(r % (K + 1));
        if (r % 2 == 0) {
          row.repetition_penalty = 1.3f;
          row.frequency_penalty = 0.4f;
          row.presence_penalty = 0.25f;
          row.penalty_begin = static_cast<int32_t>(pen.size());
          const int64_t n = std::min<int64_t>(V, 40);
          for (int64_t i = 0; i < n; ++i) {  // distinct ids: the most likely few, then random ones
            const int32_t id = static_cast<int32_t>(i < 5 ? (std::max_element(logits.f32() + r * V,
                                                                              logits.f32() + (r + 1) * V) -
                                                             (logits.f32() + r * V) + i) % V
                                                          : rng.integer(0, V - 1));
            bool dup = false;
            for (int32_t j = row.penalty_begin; j < static_cast<int32_t>(pen.size()); ++j) dup = dup || pen[j].id == id;
            if (!dup) pen.push_back({id, static_cast<int32_t>(i % 3), static_cast<int32_t>(i % 2)});
          }
          row.penalty_end = static_cast<int32_t>(pen.size());
        }
      }
      if (R > 2) logits.f32()[2 * V + V / 2] = std::nanf("");  // row 2 non-finite
      const FullOut got = full_outputs(ctx(), logits, rows, pen, K);
      const FullOut want = full_outputs(ops::Context{}, logits, rows, pen, K);
      int64_t drawn = 0, drawn_equal = 0;
      for (int64_t r = 0; r < R; ++r) {
        const float* row = logits.f32() + r * V;
        const bool bad = !std::all_of(row, row + V, [](float v) { return std::isfinite(v); });
        ASSERT_EQ(want.nonfinite[r], bad ? 1 : 0) << "row " << r;
        EXPECT_EQ(got.nonfinite[r], want.nonfinite[r]) << "row " << r;
        if (bad) continue;
        if (rows[r].temperature == 0.0f) {
          EXPECT_EQ(got.ids[r], want.ids[r]) << "greedy row " << r;
        } else {
          ++drawn;
          drawn_equal += got.ids[r] == want.ids[r];
        }
        // The reference's logprobs against log-softmax in double; the backend's against the reference's.
        double mx = -INFINITY, sum = 0.0;
        for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
        for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
        const double lse = mx + std::log(sum);
        EXPECT_NEAR(want.logprobs[r], row[want.ids[r]] - lse, 1e-5) << "row " << r;
        EXPECT_NEAR(got.logprobs[r], row[got.ids[r]] - lse, 1e-5) << "row " << r;
        std::vector<int32_t> order(static_cast<size_t>(V));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
        for (int64_t j = 0; j < K; ++j) {
          const bool have = j < std::min<int64_t>(rows[r].num_top_logprobs, V);
          const int32_t want_id = have ? order[j] : -1;
          EXPECT_EQ(want.top_ids[r * K + j], want_id) << "row " << r << " rank " << j;
          EXPECT_EQ(got.top_ids[r * K + j], want_id) << "row " << r << " rank " << j;
          if (have) {
            EXPECT_NEAR(got.top_logprobs[r * K + j], row[want_id] - lse, 1e-5) << "row " << r << " rank " << j;
          }
        }
      }
      EXPECT_GE(static_cast<double>(drawn_equal), 0.98 * static_cast<double>(drawn))
          << drawn_equal << " of " << drawn << " drawn tokens equal to the CPU's";
    }
  }
}

// Penalties decide greedy rows: the penalised argmax, computed here from the definition, on every backend.
TEST_P(OpsSampling, PenalisedGreedyIsTheArgmaxOfTheFormula) {
  auto rng = test::Rng::for_test();
  const int64_t R = 64, V = 4099;
  const Tensor logits = rng.normal_tensor({R, V}, 1.0f);
  std::vector<ops::SamplingRow> rows(R);
  std::vector<ops::PenaltyToken> pen;
  std::vector<std::vector<float>> ref(R);
  for (int64_t r = 0; r < R; ++r) {
    ops::SamplingRow& row = rows[r];
    row.repetition_penalty = r % 4 == 0 ? 1.0f : 1.5f;
    row.frequency_penalty = r % 3 == 0 ? 0.0f : 0.6f;
    row.presence_penalty = r % 2 == 0 ? 0.0f : 0.9f;
    row.penalty_begin = static_cast<int32_t>(pen.size());
    ref[r].assign(logits.f32() + r * V, logits.f32() + (r + 1) * V);
    // Penalise the current top 8 (distinct ids), so the argmax moves.
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 8, order.end(),
                      [&](int32_t a, int32_t b) { return ref[r][a] > ref[r][b]; });
    for (int i = 0; i < 8; ++i) {
      const ops::PenaltyToken t{order[i], i % 4, i % 2};
      pen.push_back(t);
      float& v = ref[r][order[i]];
      if (t.in_prompt || t.output_count > 0) v = v > 0.0f ? v / row.repetition_penalty : v * row.repetition_penalty;
      v = v - row.frequency_penalty * static_cast<float>(t.output_count);
      if (t.output_count > 0) v = v - row.presence_penalty;
    }
    row.penalty_end = static_cast<int32_t>(pen.size());
  }
  Tensor ids = output(DType::kI32, {R});
  ops::SamplingOutputs out;
  out.ids = ids;
  ops::sample_tokens(ctx(), out, on_backend(logits), rows, pen);
  const Tensor h = device::to_host(ids);
  for (int64_t r = 0; r < R; ++r) {
    EXPECT_EQ(h.i32()[r], std::max_element(ref[r].begin(), ref[r].end()) - ref[r].begin()) << "row " << r;
  }
}

// The greedy fast path (few rows, every row greedy, no penalties or logprobs) flags non-finite rows too.
TEST_P(OpsSampling, NonFiniteFlagsOnTheGreedyPath) {
  auto rng = test::Rng::for_test();
  for (int64_t V : {7, 4099, 131072}) {
    const int64_t R = 5;
    Tensor logits = rng.normal_tensor({R, V}, 1.0f);
    logits.f32()[1 * V + V - 1] = std::nanf("");
    logits.f32()[3 * V] = INFINITY;
    logits.f32()[4 * V + V / 2] = -INFINITY;
    const std::vector<ops::SamplingRow> rows(R);
    Tensor flags = output(DType::kI32, {R});
    ops::SamplingOutputs out;
    out.ids = output(DType::kI32, {R});
    out.nonfinite = flags;
    ops::sample_tokens(ctx(), out, on_backend(logits), rows, {});
    const Tensor h = device::to_host(flags);
    EXPECT_EQ(std::vector<int32_t>(h.i32(), h.i32() + R), (std::vector<int32_t>{0, 1, 0, 1, 1})) << "V=" << V;
  }
}

TEST_P(OpsSampling, RejectsBadNewParameters) {
  const Tensor logits = on_backend(Tensor::zeros(DType::kF32, {2, 8}));
  ops::SamplingOutputs out;
  out.ids = output(DType::kI32, {2});
  std::vector<ops::SamplingRow> rows(2);
  rows[1].min_p = 1.5f;
  EXPECT_TRUE(test::throws_error([&] { ops::sample_tokens(ctx(), out, logits, rows, {}); }, ErrorKind::kRuntime,
                                 "row 1: min_p 1.5 must be in [0, 1]"));
  rows[1] = ops::SamplingRow{};
  rows[1].num_top_logprobs = 3;
  EXPECT_TRUE(test::throws_error([&] { ops::sample_tokens(ctx(), out, logits, rows, {}); }, ErrorKind::kRuntime,
                                 "3 top logprobs wanted but top_ids / top_logprobs are undefined"));
  rows[1] = ops::SamplingRow{};
  rows[1].penalty_end = 1;
  EXPECT_TRUE(test::throws_error([&] { ops::sample_tokens(ctx(), out, logits, rows, {}); }, ErrorKind::kRuntime,
                                 "row 1: penalty range [0, 1) is outside the 0 penalty tokens"));
  const std::vector<ops::PenaltyToken> pen{{8, 1, 0}};
  EXPECT_TRUE(test::throws_error([&] { ops::sample_tokens(ctx(), out, logits, rows, pen); }, ErrorKind::kRuntime,
                                 "penalty token 0 is 8, outside the vocabulary [0, 8)"));
}

// Greedy rows without penalties or logprobs need no per-row parameters, so on CUDA the call can be captured in a
// graph at any row count (on both sides of the split path's 64 rows): replayed over new logits, the graph gives
// their argmax. (The speculative engine captures its verify step's sampling this way.)
TEST_P(OpsSampling, GreedyRowsCanBeCapturedInAGraph) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA graphs";
  auto rng = test::Rng::for_test();
  const device::Stream stream = device::Stream::create();
  const ops::Context c{Device::kCuda, stream.get()};
  for (int64_t R : {3, 64, 65, 300}) {
    const int64_t V = 4099;
    SCOPED_TRACE(::testing::Message() << "R=" << R);
    const Tensor logits = device::empty(Device::kCuda, DType::kF32, {R, V});
    const Tensor ids = output(DType::kI32, {R});
    const std::vector<ops::SamplingRow> rows(static_cast<size_t>(R));
    device::copy(logits, rng.normal_tensor({R, V}, 3.0f));
    ops::sample_tokens(c, ids, logits, rows);  // outside the capture first, as the engine warms up
    const device::Graph g = device::Graph::capture(stream.get(), [&] { ops::sample_tokens(c, ids, logits, rows); });
    for (int replay = 0; replay < 2; ++replay) {
      const Tensor host = tied_logits(rng, R, V);
      device::copy(logits, host);
      g.launch(stream.get());
      stream.synchronize();
      const Tensor got = device::to_host(ids);
      for (int64_t r = 0; r < R; ++r) {
        const float* row = host.f32() + r * V;
        ASSERT_EQ(got.i32()[r], std::max_element(row, row + V) - row) << "replay " << replay << " row " << r;
      }
    }
  }
}

// The verify step's greedy acceptance: per sequence the leading drafts equal to the target before them, the row the
// head drafts from, and the draft steps' contexts; awkward sequence counts and draft depths, against a direct count
// and the CPU.
TEST_P(OpsSampling, AcceptDraftsGreedyCountsTheMatchingPrefix) {
  auto rng = test::Rng::for_test();
  for (int64_t n : {1, 3, 130}) {
    for (int64_t k : {1, 2, 5}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " k=" << k);
      const int64_t w = k + 1;
      Tensor tokens = Tensor::empty(DType::kI32, {n * w}), targets = Tensor::empty(DType::kI32, {n * w});
      Tensor context = Tensor::empty(DType::kI32, {n});
      std::vector<int32_t> want(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        // Sequence i accepts a = i mod (k + 1) drafts: targets equal the next token up to there, then differ.
        const int32_t a = static_cast<int32_t>(i % w);
        want[static_cast<size_t>(i)] = a;
        context.i32()[i] = static_cast<int32_t>(rng.integer(0, 1000));
        for (int64_t j = 0; j < w; ++j) tokens.i32()[i * w + j] = static_cast<int32_t>(rng.integer(0, 50));
        for (int64_t j = 0; j < w; ++j) {
          const int32_t next = j + 1 < w ? tokens.i32()[i * w + j + 1] : 0;
          // Past the first mismatch the targets may match again: that must not count.
          targets.i32()[i * w + j] = j < a ? next : j == a ? next + 1 : (j % 2 == 0 ? next : next + 7);
        }
      }
      const auto run = [&](const ops::Context& c, auto to) {
        const Tensor accepted = to(Tensor::empty(DType::kI32, {n})), head = to(Tensor::empty(DType::kI32, {n}));
        const Tensor dctx = k > 1 ? to(Tensor::empty(DType::kI32, {k - 1, n})) : Tensor();
        ops::accept_drafts_greedy(c, accepted, head, dctx, to(tokens), to(targets), to(context));
        return std::vector<Tensor>{device::to_host(accepted), device::to_host(head),
                                   k > 1 ? device::to_host(dctx) : Tensor()};
      };
      const std::vector<Tensor> got = run(ctx(), [&](const Tensor& t) { return on_backend(t); });
      const std::vector<Tensor> ref = run(ops::Context{}, [](const Tensor& t) { return t; });
      for (int64_t i = 0; i < n; ++i) {
        const int32_t a = want[static_cast<size_t>(i)];
        ASSERT_EQ(got[0].i32()[i], a) << "sequence " << i;
        ASSERT_EQ(ref[0].i32()[i], a) << "sequence " << i;
        EXPECT_EQ(got[1].i32()[i], static_cast<int32_t>(i * w) + a);
        for (int64_t d = 0; d + 1 < k; ++d) {
          EXPECT_EQ(got[2].i32()[d * n + i], context.i32()[i] + a + static_cast<int32_t>(d) + 1);
          EXPECT_EQ(ref[2].i32()[d * n + i], got[2].i32()[d * n + i]);
        }
      }
    }
  }
}

TEST_P(OpsSampling, AcceptDraftsGreedyRejectsBadShapes) {
  const auto t = [&](Shape s) { return on_backend(Tensor::zeros(DType::kI32, std::move(s))); };
  // Rows that are not k + 1 >= 2 a sequence, and a draft_context of the wrong shape: clear errors.
  EXPECT_THROW(ops::accept_drafts_greedy(ctx(), t({2}), t({2}), Tensor(), t({5}), t({5}), t({2})), Error);
  EXPECT_THROW(ops::accept_drafts_greedy(ctx(), t({2}), t({2}), Tensor(), t({2}), t({2}), t({2})), Error);
  EXPECT_THROW(ops::accept_drafts_greedy(ctx(), t({2}), t({2}), t({1, 2}), t({8}), t({8}), t({2})), Error);
  EXPECT_NO_THROW(ops::accept_drafts_greedy(ctx(), t({2}), t({2}), t({2, 2}), t({8}), t({8}), t({2})));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsSampling);

}  // namespace
}  // namespace chimera
