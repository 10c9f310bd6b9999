// Paged causal GQA attention: prefill, chunked prefill and decode steps against one naive full pass.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"

namespace chimera {
namespace {

using test::BackendTest;

struct AttnCase {
  int64_t Qh, KVh, hd;
};

// Naive causal attention of one sequence's full history: q, k, v [L, heads, hd]; row i attends to [0, i].
Tensor naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, float scale) {
  const int64_t L = q.dim(0), Qh = q.dim(1), hd = q.dim(2), KVh = k.dim(1);
  Tensor out = Tensor::empty(DType::kF32, q.shape());
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < Qh; ++j) {
      const int64_t kh = j / (Qh / KVh);
      std::vector<double> s(static_cast<size_t>(i + 1));
      for (int64_t u = 0; u <= i; ++u) {
        double d = 0;
        for (int64_t e = 0; e < hd; ++e) d += double(q.f32()[(i * Qh + j) * hd + e]) * k.f32()[(u * KVh + kh) * hd + e];
        s[u] = d * scale;
      }
      const double m = *std::max_element(s.begin(), s.end());
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - m));
      for (int64_t e = 0; e < hd; ++e) {
        double acc = 0;
        for (int64_t u = 0; u <= i; ++u) acc += s[u] / sum * v.f32()[(u * KVh + kh) * hd + e];
        out.f32()[(i * Qh + j) * hd + e] = float(acc);
      }
    }
  }
  return out;
}

class OpsAttention : public BackendTest {};

// Sequences of total lengths `lens` are fed in steps; step r gives sequence s `steps[r][s]` new tokens.
// Every step's output rows must equal the naive full-history causal attention at those positions.
void run_steps(const ops::Context& ctx, test::Rng& rng, const AttnCase& c, const std::vector<int32_t>& lens,
               const std::vector<std::vector<int32_t>>& steps, int64_t block_size) {
  const size_t S = lens.size();
  const float scale = 1.0f / std::sqrt(float(c.hd));
  std::vector<Tensor> q, k, v, want;
  for (size_t s = 0; s < S; ++s) {
    q.push_back(rng.normal_tensor({lens[s], c.Qh, c.hd}));
    k.push_back(rng.normal_tensor({lens[s], c.KVh, c.hd}));
    v.push_back(rng.normal_tensor({lens[s], c.KVh, c.hd}));
    want.push_back(naive_attention(q[s], k[s], v[s], scale));
  }
  // Shuffled block ids, so a sequence's blocks are neither contiguous nor in order; one spare column.
  int64_t max_blocks = 0;
  for (int32_t n : lens) max_blocks = std::max<int64_t>(max_blocks, (n + block_size - 1) / block_size + 1);
  const int64_t num_blocks = int64_t(S) * max_blocks + 2;
  std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng.engine());
  Tensor tables =
      Tensor::from_i32({int64_t(S), max_blocks}, std::span<const int32_t>(ids.data(), size_t(int64_t(S) * max_blocks)));
  ops::KvCacheView cache{Tensor::empty(DType::kF32, {num_blocks, block_size, c.KVh, c.hd}),
                         Tensor::empty(DType::kF32, {num_blocks, block_size, c.KVh, c.hd})};
  test::poison(cache.k);
  test::poison(cache.v);

  std::vector<int32_t> done(S, 0);
  for (const auto& step : steps) {
    std::vector<int32_t> cu = {0};
    for (int32_t n : step) cu.push_back(cu.back() + n);
    const int64_t T = cu.back();
    Tensor qs = Tensor::empty(DType::kF32, {T, c.Qh, c.hd}), ks = Tensor::empty(DType::kF32, {T, c.KVh, c.hd});
    Tensor vs = Tensor::empty(DType::kF32, {T, c.KVh, c.hd});
    Tensor wants = Tensor::empty(DType::kF32, {T, c.Qh, c.hd});
    for (size_t s = 0; s < S; ++s) {
      for (int32_t i = 0; i < step[s]; ++i) {
        const int64_t r = cu[s] + i, pos = done[s] + i;
        std::copy_n(q[s].select(pos).f32(), c.Qh * c.hd, qs.select(r).f32());
        std::copy_n(k[s].select(pos).f32(), c.KVh * c.hd, ks.select(r).f32());
        std::copy_n(v[s].select(pos).f32(), c.KVh * c.hd, vs.select(r).f32());
        std::copy_n(want[s].select(pos).f32(), c.Qh * c.hd, wants.select(r).f32());
      }
    }
    Tensor out = Tensor::empty(DType::kF32, {T, c.Qh, c.hd});
    test::poison(out);
    ops::attention(ctx, out, qs, ks, vs, cache, cu, done, tables, scale);
    EXPECT_TRUE(test::nmse_close(out, wants, test::kF32ReductionNmse, test::kF32Reduction));
    for (size_t s = 0; s < S; ++s) done[s] += step[s];
  }
  // The cache holds exactly every sequence's k, v at its positions (bit-exact copies).
  for (size_t s = 0; s < S; ++s) {
    for (int32_t pos = 0; pos < done[s]; ++pos) {
      const int64_t blk = tables.i32()[int64_t(s) * max_blocks + pos / block_size];
      const int64_t off = pos % block_size;
      ASSERT_TRUE(test::bit_equal(cache.k.select(blk).select(off), k[s].select(pos)));
      ASSERT_TRUE(test::bit_equal(cache.v.select(blk).select(off), v[s].select(pos)));
    }
  }
  // Blocks no sequence owns stay untouched.
  for (int64_t b = int64_t(S) * max_blocks; b < num_blocks; ++b) {
    EXPECT_TRUE(std::isnan(cache.k.select(ids[size_t(b)]).f32()[0]));
  }
}

const AttnCase kCases[] = {{6, 2, 20}, {5, 5, 33}, {3, 1, 8}, {8, 2, 128}};

TEST_P(OpsAttention, PrefillMatchesNaive) {
  auto rng = test::Rng::for_test();
  for (const AttnCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "Qh=" << c.Qh << " KVh=" << c.KVh << " hd=" << c.hd);
    const std::vector<int32_t> lens = {1, 17, 5};
    run_steps(ctx(), rng, c, lens, {lens}, 4);
  }
}

TEST_P(OpsAttention, ChunkedPrefillThenDecodeEqualsFullAttention) {
  auto rng = test::Rng::for_test();
  for (const AttnCase& c : kCases) {
    for (int64_t block_size : {1, 4, 16}) {
      SCOPED_TRACE(::testing::Message() << "Qh=" << c.Qh << " KVh=" << c.KVh << " hd=" << c.hd << " bs=" << block_size);
      // Two chunked-prefill steps (one sequence idle in the second), then three decode steps.
      const std::vector<int32_t> lens = {12, 25, 4};
      run_steps(ctx(), rng, c, lens, {{7, 19, 1}, {2, 3, 0}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}}, block_size);
    }
  }
}

TEST_P(OpsAttention, BadShapesThrowNamingTheOp) {
  const Tensor q = Tensor::zeros(DType::kF32, {3, 4, 8}), kv = Tensor::zeros(DType::kF32, {3, 3, 8});
  Tensor out = Tensor::empty(DType::kF32, {3, 4, 8});
  ops::KvCacheView cache{Tensor::zeros(DType::kF32, {2, 4, 3, 8}), Tensor::zeros(DType::kF32, {2, 4, 3, 8})};
  const Tensor tables = Tensor::from_i32({1, 1}, std::vector<int32_t>{0});
  const std::vector<int32_t> cu = {0, 3}, ctx_lens = {0};
  EXPECT_TRUE(test::throws_error([&] { ops::attention(ctx(), out, q, kv, kv, cache, cu, ctx_lens, tables, 1.0f); },
                                 ErrorKind::kRuntime, "ops::attention: k F32[3, 3, 8] has 3 heads"));
  const Tensor kv2 = Tensor::zeros(DType::kF32, {3, 2, 8});
  ops::KvCacheView cache2{Tensor::zeros(DType::kF32, {2, 4, 2, 8}), Tensor::zeros(DType::kF32, {2, 4, 2, 8})};
  EXPECT_TRUE(test::throws_error(
      [&] { ops::attention(ctx(), out, q, kv2, kv2, cache2, cu, std::vector<int32_t>{2}, tables, 1.0f); },
      ErrorKind::kRuntime, "ops::attention: sequence 0 needs 5 positions"));
  const Tensor bad_tables = Tensor::from_i32({1, 1}, std::vector<int32_t>{2});
  EXPECT_TRUE(
      test::throws_error([&] { ops::attention(ctx(), out, q, kv2, kv2, cache2, cu, ctx_lens, bad_tables, 1.0f); },
                         ErrorKind::kRuntime, "ops::attention: block_tables[0, 0] = 2 is out of range for 2 blocks"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsAttention);

}  // namespace
}  // namespace chimera
