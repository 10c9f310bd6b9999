// causal_conv1d / causal_conv1d_update: packed batches with per-slot state, against a naive loop.
#include <cmath>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"

namespace chimera {
namespace {

using test::BackendTest;

// Naive oracle: per sequence, history = conv_state[slot] (K-1 columns) ++ new inputs; double accumulation.
// Updates `state` (a host copy) and writes `out` rows; pad sequences are skipped.
void naive_conv(Tensor& out, const Tensor& x, const Tensor& w_any, const Tensor& bias, Tensor& state,
                const std::vector<int32_t>& cu, const std::vector<int32_t>& slots, bool silu) {
  const int64_t C = x.dim(1);
  const Tensor w = w_any.to_f32();
  const int64_t K = w.numel() / C;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] < 0) continue;
    const int64_t n = cu[s + 1] - cu[s];
    for (int64_t c = 0; c < C; ++c) {
      std::vector<double> hist;
      float* st = state.f32() + (slots[s] * C + c) * (K - 1);
      for (int64_t j = 0; j < K - 1; ++j) hist.push_back(st[j]);
      for (int64_t t = 0; t < n; ++t) hist.push_back(x.f32()[(cu[s] + t) * C + c]);
      for (int64_t t = 0; t < n; ++t) {
        double acc = bias ? bias.f32()[c] : 0.0;
        for (int64_t j = 0; j < K; ++j) acc += double(w.f32()[c * K + j]) * hist[size_t(t + j)];
        out.f32()[(cu[s] + t) * C + c] = float(silu ? acc / (1.0 + std::exp(-acc)) : acc);
      }
      for (int64_t j = 0; j < K - 1; ++j) st[j] = float(hist[size_t(n + j)]);
    }
  }
}

std::vector<int32_t> cu_from(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

class OpsConv1d : public BackendTest {};

TEST_P(OpsConv1d, PackedBatchWithSlotsMatchesNaive) {
  auto rng = test::Rng::for_test();
  // Mixed lengths incl. 1, one shorter than K-1, an empty one and a pad; permuted, non-contiguous slots.
  const std::vector<int32_t> lens = {17, 1, 2, 5, 0, 13};
  const std::vector<int32_t> slots = {5, 0, 3, -1, 6, 2};
  const auto cu = cu_from(lens);
  const int64_t T = cu.back(), num_slots = 8;
  for (int64_t K : {4, 2}) {
    for (int64_t C : {33, 500}) {
      for (bool silu : {true, false}) {
        for (DType wt : {DType::kF32, DType::kBF16}) {
          SCOPED_TRACE(::testing::Message() << "K=" << K << " C=" << C << " silu=" << silu << " w=" << dtype_name(wt));
          const Tensor x = rng.normal_tensor({T, C});
          // The checkpoint layout [C, 1, K] for bf16, [C, K] for f32: both accepted.
          const Tensor w =
              test::cast_to(rng.normal_tensor(wt == DType::kBF16 ? Shape{C, 1, K} : Shape{C, K}, 0.5f), wt);
          const Tensor bias = rng.normal_tensor({C});
          const Tensor state0 = rng.normal_tensor({num_slots, C, K - 1});
          Tensor out = Tensor::empty(DType::kF32, {T, C}), want = Tensor::empty(DType::kF32, {T, C});
          test::poison(out);
          test::poison(want);
          Tensor state = state0.clone(), want_state = state0.clone();
          ops::causal_conv1d(ctx(), out, x, w, bias, state, cu, slots, silu);
          naive_conv(want, x, w, bias, want_state, cu, slots, silu);
          EXPECT_ALL_CLOSE(out, want, test::kF32Elementwise);  // pad rows stay poisoned on both sides
          EXPECT_ALL_CLOSE(state, want_state, test::kF32Elementwise);
          // Untouched slots (1, 4, 7, and the empty sequence's 6) are bit-identical.
          for (int64_t s : {1, 4, 6, 7}) EXPECT_TRUE(test::bit_equal(state.select(s), state0.select(s))) << s;
        }
      }
    }
  }
}

TEST_P(OpsConv1d, NoBiasMatchesNaive) {
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> cu = {0, 3, 20}, slots = {1, 0};
  const Tensor x = rng.normal_tensor({20, 33}), w = rng.normal_tensor({33, 4});
  Tensor state = rng.normal_tensor({2, 33, 3}), want_state = state.clone();
  Tensor out = Tensor::empty(DType::kF32, {20, 33}), want = Tensor::empty(DType::kF32, {20, 33});
  ops::causal_conv1d(ctx(), out, x, w, Tensor(), state, cu, slots, true);
  naive_conv(want, x, w, Tensor(), want_state, cu, slots, true);
  EXPECT_ALL_CLOSE(out, want, test::kF32Elementwise);
  EXPECT_ALL_CLOSE(state, want_state, test::kF32Elementwise);
}

TEST_P(OpsConv1d, SplitInTwoCallsEqualsOneCall) {
  auto rng = test::Rng::for_test();
  const int64_t C = 33, K = 4;
  for (int32_t split : {1, 2, 9, 22}) {
    const int32_t n = 23;
    const Tensor x = rng.normal_tensor({n, C}), w = rng.normal_tensor({C, K}), bias = rng.normal_tensor({C});
    const Tensor state0 = rng.normal_tensor({3, C, K - 1});
    const std::vector<int32_t> slot = {2};
    Tensor whole = Tensor::empty(DType::kF32, {n, C}), parts = Tensor::empty(DType::kF32, {n, C});
    test::poison(whole);
    test::poison(parts);
    Tensor s_whole = state0.clone(), s_parts = state0.clone();
    ops::causal_conv1d(ctx(), whole, x, w, bias, s_whole, std::vector<int32_t>{0, n}, slot, true);
    ops::causal_conv1d(ctx(), parts.rows(0, split), x.rows(0, split), w, bias, s_parts, std::vector<int32_t>{0, split},
                       slot, true);
    ops::causal_conv1d(ctx(), parts.rows(split, n), x.rows(split, n), w, bias, s_parts,
                       std::vector<int32_t>{0, n - split}, slot, true);
    EXPECT_TRUE(test::bit_equal(parts, whole)) << "split " << split;
    EXPECT_TRUE(test::bit_equal(s_parts, s_whole)) << "split " << split;
  }
}

TEST_P(OpsConv1d, UpdateEqualsOneTokenConv) {
  auto rng = test::Rng::for_test();
  for (int64_t K : {2, 4}) {
    const int64_t C = 500, Bn = 5;
    const std::vector<int32_t> slots = {4, -1, 0, 6, 2};
    const Tensor x = rng.normal_tensor({Bn, C}), w = rng.normal_tensor({C, 1, K}), bias = rng.normal_tensor({C});
    const Tensor state0 = rng.normal_tensor({7, C, K - 1});
    Tensor out_u = Tensor::empty(DType::kF32, {Bn, C}), out_c = Tensor::empty(DType::kF32, {Bn, C});
    test::poison(out_u);
    test::poison(out_c);
    Tensor s_u = state0.clone(), s_c = state0.clone();
    ops::causal_conv1d_update(ctx(), out_u, x, w, bias, s_u, slots, true);
    ops::causal_conv1d(ctx(), out_c, x, w, bias, s_c, cu_from(std::vector<int32_t>(Bn, 1)), slots, true);
    EXPECT_TRUE(test::bit_equal(out_u, out_c));
    EXPECT_TRUE(test::bit_equal(s_u, s_c));
    EXPECT_TRUE(std::isnan(out_u.f32()[1 * C]));  // the pad row is left untouched
  }
}

TEST_P(OpsConv1d, BadShapesThrowNamingTheOp) {
  const Tensor x = Tensor::zeros(DType::kF32, {4, 8});
  Tensor out = Tensor::empty(DType::kF32, {4, 8});
  const Tensor w = Tensor::zeros(DType::kF32, {8, 4});
  Tensor state = Tensor::zeros(DType::kF32, {2, 8, 3});
  const std::vector<int32_t> cu = {0, 4}, slot = {0};
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::causal_conv1d(ctx(), out, x, w, Tensor(), Tensor::zeros(DType::kF32, {2, 8, 4}), cu, slot, true);
      },
      ErrorKind::kRuntime, "ops::causal_conv1d: conv_state F32[2, 8, 4] does not match weight F32[8, 4]"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::causal_conv1d(ctx(), out, x, w, Tensor(), state, std::vector<int32_t>{0, 3}, slot, true);
      },
      ErrorKind::kRuntime, "ops::causal_conv1d: cu_seqlens ends at 3 but the batch has 4 rows"));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::causal_conv1d(ctx(), out, x, w, Tensor(), state, cu, std::vector<int32_t>{2}, true); },
      ErrorKind::kRuntime, "ops::causal_conv1d: slot 2 of sequence 0 is out of range for 2 state slots"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::causal_conv1d_update(ctx(), out, x, w, Tensor(), state, std::vector<int32_t>{0, 1, 1, -1}, true);
      },
      ErrorKind::kRuntime, "ops::causal_conv1d_update: slot 1 is used by more than one sequence"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsConv1d);

}  // namespace
}  // namespace chimera
