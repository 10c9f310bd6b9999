// Mamba-2 SSM: ssd_chunk_scan == ssm_recurrence == a naive double recurrence; prefill then decode.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"

namespace chimera {
namespace {

using test::BackendTest;

struct SsmCase {
  int64_t H, P, G, N;
};

struct SsmInputs {
  Tensor x, dt_raw, B, C;  // [T, H, P], [T, H], [T, G, N], [T, G, N]
  ops::SsmParams p;
};

SsmInputs make_inputs(test::Rng& rng, int64_t T, const SsmCase& c) {
  SsmInputs in;
  in.x = rng.normal_tensor({T, c.H, c.P});
  in.dt_raw = rng.normal_tensor({T, c.H});
  in.B = rng.normal_tensor({T, c.G, c.N}, 0.5f);
  in.C = rng.normal_tensor({T, c.G, c.N}, 0.5f);
  in.p.A_log = rng.uniform_tensor({c.H}, 0.0f, 2.5f);  // A in [-12, -1]
  in.p.D = rng.normal_tensor({c.H});
  in.p.dt_bias = rng.uniform_tensor({c.H}, -4.0f, -1.0f);
  return in;
}

// Naive recurrence (model-spec 3.3) in double; the state is a host copy updated in place.
void naive_ssm(Tensor& y, const SsmInputs& in, Tensor& state, const std::vector<int32_t>& cu,
               const std::vector<int32_t>& slots) {
  const int64_t H = in.x.dim(1), P = in.x.dim(2), G = in.B.dim(1), N = in.B.dim(2);
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      std::vector<double> S(static_cast<size_t>(P * N));
      float* st = state.f32() + (slots[s] * H + h) * P * N;
      for (int64_t e = 0; e < P * N; ++e) S[e] = st[e];
      const double A = -std::exp(double(in.p.A_log.f32()[h]));
      for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
        const double v = double(in.dt_raw.f32()[t * H + h]) + in.p.dt_bias.f32()[h];
        double dt = v > 20.0 ? v : std::log1p(std::exp(v));
        dt = std::clamp(dt, double(in.p.dt_min), double(in.p.dt_max));
        const double dA = std::exp(dt * A);
        for (int64_t pi = 0; pi < P; ++pi) {
          const double xv = in.x.f32()[(t * H + h) * P + pi];
          double acc = 0;
          for (int64_t n = 0; n < N; ++n) {
            double& sv = S[pi * N + n];
            sv = sv * dA + dt * xv * in.B.f32()[(t * G + g) * N + n];
            acc += sv * in.C.f32()[(t * G + g) * N + n];
          }
          y.f32()[(t * H + h) * P + pi] = float(acc + in.p.D.f32()[h] * xv);
        }
      }
      for (int64_t e = 0; e < P * N; ++e) st[e] = float(S[e]);
    }
  }
}

std::vector<int32_t> cu_from(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

// Pad sequences' rows must be left untouched (still poisoned); they are then zeroed on both sides so the
// normalised-MSE comparison covers the rest.
void expect_pad_rows_untouched(Tensor& y, Tensor& want, const std::vector<int32_t>& cu,
                               const std::vector<int32_t>& slots) {
  const int64_t row = y.numel() / y.dim(0);
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] >= 0) continue;
    for (int64_t i = cu[s] * row; i < cu[s + 1] * row; ++i) {
      EXPECT_TRUE(std::isnan(y.f32()[i])) << "pad row element " << i << " was written";
      y.f32()[i] = want.f32()[i] = 0.0f;
    }
  }
}

const SsmCase kCases[] = {{3, 5, 1, 7}, {4, 8, 2, 16}, {8, 4, 8, 3}, {6, 16, 2, 32}};

class OpsSsd : public BackendTest {};

TEST_P(OpsSsd, RecurrenceMatchesNaive) {
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {1, 17, 3, 40}, slots = {2, -1, 0, 4};
  const auto cu = cu_from(lens);
  for (const SsmCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "H=" << c.H << " P=" << c.P << " G=" << c.G << " N=" << c.N);
    const SsmInputs in = make_inputs(rng, cu.back(), c);
    const Tensor state0 = rng.normal_tensor({5, c.H, c.P, c.N});
    Tensor y = Tensor::empty(DType::kF32, in.x.shape()), want = Tensor::empty(DType::kF32, in.x.shape());
    test::poison(y);
    test::poison(want);
    Tensor state = state0.clone(), want_state = state0.clone();
    ops::ssm_recurrence(ctx(), y, in.x, in.dt_raw, in.B, in.C, in.p, state, cu, slots);
    naive_ssm(want, in, want_state, cu, slots);
    expect_pad_rows_untouched(y, want, cu, slots);
    EXPECT_TRUE(test::nmse_close(y, want, test::kF32ReductionNmse, test::kF32Reduction));
    EXPECT_TRUE(test::nmse_close(state, want_state, test::kF32ReductionNmse, test::kF32Reduction));
  }
}

TEST_P(OpsSsd, ChunkScanMatchesRecurrence) {
  auto rng = test::Rng::for_test();
  // Mixed lengths packed in one batch (1 token, exactly one chunk, crossing chunk boundaries, an empty one),
  // permuted non-contiguous slots and a pad.
  const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> batches = {
      {{1}, {0}},
      {{111}, {3}},
      {{17, 1, 40, 8, 0, 23}, {4, 1, -1, 6, 2, 0}},
  };
  for (const auto& [lens, slots] : batches) {
    const auto cu = cu_from(lens);
    for (const SsmCase& c : kCases) {
      for (int64_t chunk : {1, 4, 7, 16, 64}) {
        for (bool fresh : {true, false}) {
          SCOPED_TRACE(::testing::Message() << "seqs=" << lens.size() << " H=" << c.H << " P=" << c.P << " G=" << c.G
                                            << " N=" << c.N << " chunk=" << chunk << " fresh=" << fresh);
          SsmInputs in = make_inputs(rng, cu.back(), c);
          const Tensor state0 =
              fresh ? Tensor::zeros(DType::kF32, {8, c.H, c.P, c.N}) : rng.normal_tensor({8, c.H, c.P, c.N});
          Tensor y = Tensor::empty(DType::kF32, in.x.shape()), want = Tensor::empty(DType::kF32, in.x.shape());
          test::poison(y);
          test::poison(want);
          Tensor state = state0.clone(), want_state = state0.clone();
          ops::ssd_chunk_scan(ctx(), y, in.x, in.dt_raw, in.B, in.C, in.p, state, cu, slots, chunk);
          ops::ssm_recurrence(ctx(), want, in.x, in.dt_raw, in.B, in.C, in.p, want_state, cu, slots);
          expect_pad_rows_untouched(y, want, cu, slots);
          ASSERT_TRUE(test::nmse_close(y, want, test::kF32ReductionNmse, test::kF32Reduction));
          ASSERT_TRUE(test::nmse_close(state, want_state, test::kF32ReductionNmse, test::kF32Reduction));
          // Slots no sequence uses, and the pad, keep their bits.
          for (int64_t s = 0; s < 8; ++s) {
            if (std::find(slots.begin(), slots.end(), s) == slots.end() ||
                lens[size_t(std::find(slots.begin(), slots.end(), s) - slots.begin())] == 0) {
              ASSERT_TRUE(test::bit_equal(state.select(s), state0.select(s))) << "slot " << s;
            }
          }
        }
      }
    }
  }
}

TEST_P(OpsSsd, DtLimitsClampBothPaths) {
  auto rng = test::Rng::for_test();
  const SsmCase c{4, 8, 2, 16};
  const std::vector<int32_t> cu = {0, 37}, slots = {0};
  SsmInputs in = make_inputs(rng, 37, c);
  in.p.dt_min = 0.02f;
  in.p.dt_max = 0.08f;
  Tensor y = Tensor::empty(DType::kF32, in.x.shape()), want = Tensor::empty(DType::kF32, in.x.shape());
  Tensor state = rng.normal_tensor({1, c.H, c.P, c.N}), want_state = state.clone();
  ops::ssd_chunk_scan(ctx(), y, in.x, in.dt_raw, in.B, in.C, in.p, state, cu, slots, 8);
  naive_ssm(want, in, want_state, cu, slots);
  EXPECT_TRUE(test::nmse_close(y, want, test::kF32ReductionNmse, test::kF32Reduction));
  EXPECT_TRUE(test::nmse_close(state, want_state, test::kF32ReductionNmse, test::kF32Reduction));
}

TEST_P(OpsSsd, PrefillThenDecodeMatchesRecurrence) {
  auto rng = test::Rng::for_test();
  const SsmCase c{6, 16, 2, 32};
  // Three sequences: prefill lengths 5, 17, 1, then 4 decode steps each (slots permuted).
  const std::vector<int32_t> prefill = {5, 17, 1}, slots = {3, 0, 2};
  const int64_t steps = 4;
  std::vector<int32_t> total;
  for (int32_t n : prefill) total.push_back(n + int32_t(steps));
  const auto cu_total = cu_from(total);
  const SsmInputs all = make_inputs(rng, cu_total.back(), c);
  const Tensor state0 = rng.normal_tensor({4, c.H, c.P, c.N});
  Tensor want = Tensor::empty(DType::kF32, all.x.shape()), want_state = state0.clone();
  naive_ssm(want, all, want_state, cu_total, slots);

  // Gathers rows of every sequence's [begin, begin + count) into a packed tensor.
  auto gather = [&](const Tensor& t, const std::vector<int32_t>& begin, const std::vector<int32_t>& count) {
    Shape shape = t.shape();
    shape[0] = std::accumulate(count.begin(), count.end(), int64_t{0});
    Tensor g = Tensor::empty(DType::kF32, shape);
    int64_t r = 0;
    for (size_t s = 0; s < begin.size(); ++s) {
      for (int32_t i = 0; i < count[s]; ++i, ++r) {
        std::copy_n(t.select(cu_total[s] + begin[s] + i).f32(), g.numel() / shape[0], g.select(r).f32());
      }
    }
    return g;
  };
  Tensor state = state0.clone();
  const std::vector<int32_t> zeros(3, 0);
  {
    const Tensor x = gather(all.x, zeros, prefill), dt = gather(all.dt_raw, zeros, prefill);
    const Tensor B = gather(all.B, zeros, prefill), C = gather(all.C, zeros, prefill);
    Tensor y = Tensor::empty(DType::kF32, x.shape());
    ops::ssd_chunk_scan(ctx(), y, x, dt, B, C, all.p, state, cu_from(prefill), slots, 4);
    EXPECT_TRUE(test::nmse_close(y, gather(want, zeros, prefill), test::kF32ReductionNmse, test::kF32Reduction));
  }
  for (int64_t step = 0; step < steps; ++step) {
    const std::vector<int32_t> ones(3, 1);
    std::vector<int32_t> at(prefill);
    for (auto& a : at) a += int32_t(step);
    const Tensor x = gather(all.x, at, ones), dt = gather(all.dt_raw, at, ones);
    const Tensor B = gather(all.B, at, ones), C = gather(all.C, at, ones);
    Tensor y = Tensor::empty(DType::kF32, x.shape());
    test::poison(y);
    ops::selective_state_update(ctx(), y, x, dt, B, C, all.p, state, slots);
    EXPECT_TRUE(test::nmse_close(y, gather(want, at, ones), test::kF32ReductionNmse, test::kF32Reduction))
        << "step " << step;
  }
  EXPECT_TRUE(test::nmse_close(state, want_state, test::kF32ReductionNmse, test::kF32Reduction));
}

TEST_P(OpsSsd, SelectiveStateUpdateSkipsPad) {
  auto rng = test::Rng::for_test();
  const SsmCase c{3, 5, 1, 7};
  const SsmInputs in = make_inputs(rng, 3, c);
  const Tensor state0 = rng.normal_tensor({3, c.H, c.P, c.N});
  Tensor state = state0.clone();
  Tensor y = Tensor::empty(DType::kF32, in.x.shape());
  test::poison(y);
  ops::selective_state_update(ctx(), y, in.x, in.dt_raw, in.B, in.C, in.p, state, std::vector<int32_t>{2, -1, 0});
  EXPECT_TRUE(std::isnan(y.f32()[1 * c.H * c.P]));
  EXPECT_FALSE(std::isnan(y.f32()[0]));
  EXPECT_TRUE(test::bit_equal(state.select(1), state0.select(1)));
}

TEST_P(OpsSsd, BadShapesThrowNamingTheOp) {
  auto rng = test::Rng::for_test();
  const SsmInputs in = make_inputs(rng, 6, {4, 8, 2, 16});
  Tensor y = Tensor::empty(DType::kF32, in.x.shape()), state = Tensor::zeros(DType::kF32, {2, 4, 8, 16});
  const std::vector<int32_t> cu = {0, 6}, slot = {1};
  const Tensor B3 = Tensor::zeros(DType::kF32, {6, 3, 16});
  EXPECT_TRUE(test::throws_error(
      [&] { ops::ssd_chunk_scan(ctx(), y, in.x, in.dt_raw, B3, B3, in.p, state, cu, slot, 4); }, ErrorKind::kRuntime,
      "ops::ssd_chunk_scan: B F32[6, 3, 16] has 3 groups, which do not divide the 4 heads of x F32[6, 4, 8]"));
  EXPECT_TRUE(
      test::throws_error([&] { ops::ssd_chunk_scan(ctx(), y, in.x, in.dt_raw, in.B, in.C, in.p, state, cu, slot, 0); },
                         ErrorKind::kRuntime, "ops::ssd_chunk_scan: chunk_size 0 must be positive"));
  Tensor bad_state = Tensor::zeros(DType::kF32, {2, 4, 8, 15});
  EXPECT_TRUE(test::throws_error(
      [&] { ops::ssm_recurrence(ctx(), y, in.x, in.dt_raw, in.B, in.C, in.p, bad_state, cu, slot); },
      ErrorKind::kRuntime, "ops::ssm_recurrence: ssm_state F32[2, 4, 8, 15] does not match x F32[6, 4, 8]"));
  ops::SsmParams p = in.p;
  p.D = Tensor::zeros(DType::kF32, {3});
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::selective_state_update(ctx(), y, in.x, in.dt_raw, in.B, in.C, p, state, std::vector<int32_t>(6, -1));
      },
      ErrorKind::kRuntime, "ops::selective_state_update: D F32[3] does not match x"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsSsd);

}  // namespace
}  // namespace chimera
