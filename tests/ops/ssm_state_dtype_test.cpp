// The Mamba SSM state in F32, BF16 and F16 (--mamba-ssm-cache-dtype; ops.h SsmParams): every op that writes the
// state (selective_state_update in and out of place, ssd_chunk_scan, ssm_recurrence, the fused decode kernel) rounds
// it as documented, on every backend, to the byte:
//   * BF16: round to nearest even; F16: stochastic rounding with the bits of (state_seed, position, element).
//   * The inputs are chosen so that the fp32 value before rounding is exact whatever the order of the sums (A = 0 so
//     every decay is exp(0) = 1, dt pinned to 0.5 by dt_min = dt_max, x and B small dyadic rationals, the prefill's
//     initial state on a 2^-13 grid): the expected state bytes are then computed here from the formula alone, and
//     the CPU reference and every CUDA kernel (portable, grid, persistent, tensor-core scan) must produce them
//     exactly. Together: the CPU and CUDA state bytes are identical.
//   * The fused CUDA decode kernel writes the same F16 / BF16 state bytes as the three separate kernels.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#include "core/stochastic_rounding.h"

namespace chimera {
namespace {

using test::BackendTest;

struct Dims {
  int64_t H, P, G, N;
};

// Values k / denom, k uniform in [-2 denom, 2 denom].
Tensor dyadic(test::Rng& rng, Shape shape, int64_t denom) {
  Tensor t = Tensor::empty(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.f32()[i] = static_cast<float>(rng.integer(-2 * denom, 2 * denom)) / static_cast<float>(denom);
  }
  return t;
}

// Writes v into element i of a host state of any state dtype, rounded as the ops round it.
void put(Tensor& state, int64_t i, float v, uint64_t key, uint32_t e) {
  switch (state.dtype()) {
    case DType::kF32: state.f32()[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(state.data())[i] = f32_to_bf16(v); break;
    case DType::kF16: static_cast<uint16_t*>(state.data())[i] = f32_to_f16_stochastic(v, ssm_rounding_bits(key, e)); break;
    default: FAIL() << "state dtype";
  }
}

constexpr DType kStateDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

class OpsSsmStateDtype : public BackendTest {
 protected:
  // A = -exp(-200) = -0 (every decay exactly 1), dt = 0.5 whatever dt_raw and dt_bias are; on the backend.
  ops::SsmParams pinned_params(test::Rng& rng, int64_t H) const {
    ops::SsmParams p;
    Tensor a_log = Tensor::empty(DType::kF32, {H});
    std::fill_n(a_log.f32(), H, -200.0f);
    p.A_log = on_backend(a_log);
    p.D = on_backend(rng.normal_tensor({H}));
    p.dt_bias = on_backend(rng.normal_tensor({H}));
    p.dt_min = p.dt_max = 0.5f;
    p.state_seed = rng.engine()();
    return p;
  }

  // Activation dtypes to run: F32 everywhere, BF16 too on CUDA (the dyadic inputs are exact in bf16).
  std::vector<DType> acts() const {
    return on_cuda() ? std::vector<DType>{DType::kF32, DType::kBF16} : std::vector<DType>{DType::kF32};
  }

  // One decode step of `batch` rows (slots with pads, random positions), in place or out of place, against the
  // formula: new state = old + (0.5 x) B, rounded per dtype with each row's position; other slots keep their bytes.
  void check_ssu(test::Rng& rng, const Dims& d, int64_t batch, DType act, DType sd, bool oop) {
    SCOPED_TRACE(::testing::Message() << "H=" << d.H << " P=" << d.P << " G=" << d.G << " N=" << d.N << " batch="
                                      << batch << " act=" << dtype_name(act) << " state=" << dtype_name(sd)
                                      << (oop ? " out of place" : ""));
    const int64_t num_slots = 2 * batch + 3;
    const Tensor x = dyadic(rng, {batch, d.H, d.P}, 8), B = dyadic(rng, {batch, d.G, d.N}, 8);
    const Tensor C = rng.normal_tensor({batch, d.G, d.N}), dt = rng.normal_tensor({batch, d.H});
    ops::SsmParams p = pinned_params(rng, d.H);
    std::vector<int32_t> slots = test::batch_slots(rng, batch, num_slots), dst;
    if (oop) {  // destinations: slots nobody reads
      std::vector<bool> used(static_cast<size_t>(num_slots), false);
      for (int32_t s : slots) {
        if (s >= 0) used[static_cast<size_t>(s)] = true;
      }
      int32_t next = 0;
      for (int32_t s : slots) {
        while (used[static_cast<size_t>(next)]) ++next;
        dst.push_back(s < 0 ? 0 : next);
        if (s >= 0) used[static_cast<size_t>(next)] = true;
      }
    }
    std::vector<int32_t> context(static_cast<size_t>(batch));
    for (int32_t& c : context) c = static_cast<int32_t>(rng.integer(0, 100000));
    p.context_lens = context;
    // Any state values: the update is one exact product added once, so a single fp32 rounding.
    const Tensor init = test::cast_to(rng.uniform_tensor({num_slots, d.H, d.P, d.N}, -2.0f, 2.0f), sd);
    const Tensor state = on_backend(init);
    const Tensor y = output(act, {batch, d.H, d.P});
    if (oop) {
      ops::selective_state_update(ctx(), y, on_backend(x, act), on_backend(dt, act), on_backend(B, act),
                                  on_backend(C, act), p, state, slots, dst);
    } else {
      ops::selective_state_update(ctx(), y, on_backend(x, act), on_backend(dt, act), on_backend(B, act),
                                  on_backend(C, act), p, state, slots);
    }
    Tensor want = init.clone();
    const int64_t H = d.H, P = d.P, N = d.N, hpg = d.H / d.G;
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t src = slots[static_cast<size_t>(b)];
      if (src < 0) continue;
      const int64_t to = oop ? dst[static_cast<size_t>(b)] : src;
      const uint64_t key = ssm_rounding_key(p.state_seed, context[static_cast<size_t>(b)]);
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t pi = 0; pi < P; ++pi) {
          const float dtx = 0.5f * x.f32()[(b * H + h) * P + pi];
          for (int64_t n = 0; n < N; ++n) {
            const int64_t e = (h * P + pi) * N + n;
            const float v = load_as_f32(init.data(), sd, static_cast<size_t>(src * H * P * N + e)) +
                            dtx * B.f32()[(b * d.G + h / hpg) * N + n];
            put(want, to * H * P * N + e, v, key, static_cast<uint32_t>(e));
          }
        }
      }
    }
    const Tensor got = device::to_host(state);
    for (int64_t s = 0; s < num_slots; ++s) ASSERT_TRUE(test::bit_equal(got.select(s), want.select(s))) << "slot " << s;
  }

  // A prefill over sequences of `lens` (every third a pad), then the recurrence over the same rows, against the
  // formula: final state = initial + sum_t (0.5 x_t) B_t, exact in fp32 on this grid, rounded with the position of
  // the sequence's last token.
  void check_prefill(test::Rng& rng, const Dims& d, const std::vector<int32_t>& lens, DType act, DType sd,
                     bool recurrence) {
    SCOPED_TRACE(::testing::Message() << "H=" << d.H << " P=" << d.P << " N=" << d.N << " act=" << dtype_name(act)
                                      << " state=" << dtype_name(sd) << (recurrence ? " recurrence" : " scan"));
    std::vector<int32_t> cu{0}, slots, context;
    for (size_t s = 0; s < lens.size(); ++s) {
      cu.push_back(cu.back() + lens[s]);
      slots.push_back(s % 3 == 2 ? -1 : static_cast<int32_t>(lens.size() - s));
      context.push_back(static_cast<int32_t>(rng.integer(0, 5000)));
    }
    const int64_t T = cu.back(), num_slots = static_cast<int64_t>(lens.size()) + 2;
    // x, B on a 2^-6 grid (0.5 x B on 2^-13), the initial state on 2^-13 rounded to the state dtype (a coarser grid
    // of the same lattice): every partial sum is a multiple of 2^-13 below 2^10, exact in fp32.
    const Tensor x = dyadic(rng, {T, d.H, d.P}, 64), B = dyadic(rng, {T, d.G, d.N}, 64);
    const Tensor C = rng.normal_tensor({T, d.G, d.N}), dt = rng.normal_tensor({T, d.H});
    ops::SsmParams p = pinned_params(rng, d.H);
    p.context_lens = context;
    const Tensor init = test::cast_to(dyadic(rng, {num_slots, d.H, d.P, d.N}, 8192), sd);
    const Tensor state = on_backend(init);
    const Tensor y = output(act, {T, d.H, d.P});
    if (recurrence) {
      ops::ssm_recurrence(ctx(), y, on_backend(x, act), on_backend(dt, act), on_backend(B, act), on_backend(C, act), p,
                          state, cu, slots);
    } else {
      ops::ssd_chunk_scan(ctx(), y, on_backend(x, act), on_backend(dt, act), on_backend(B, act), on_backend(C, act), p,
                          state, cu, slots, 128);
    }
    Tensor want = init.clone();
    const int64_t H = d.H, P = d.P, N = d.N, hpg = d.H / d.G;
    std::vector<float> acc(static_cast<size_t>(H * P * N));
    for (size_t s = 0; s < lens.size(); ++s) {
      if (slots[s] < 0) continue;
      const int64_t base = slots[s] * H * P * N;
      for (int64_t e = 0; e < H * P * N; ++e) acc[e] = load_as_f32(init.data(), sd, static_cast<size_t>(base + e));
      for (int64_t t = cu[s]; t < cu[s + 1]; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t pi = 0; pi < P; ++pi) {
            const float dtx = 0.5f * x.f32()[(t * H + h) * P + pi];
            for (int64_t n = 0; n < N; ++n) acc[(h * P + pi) * N + n] += dtx * B.f32()[(t * d.G + h / hpg) * N + n];
          }
        }
      }
      const uint64_t key = ssm_rounding_key(p.state_seed, context[s] + lens[s] - 1);
      for (int64_t e = 0; e < H * P * N; ++e) put(want, base + e, acc[e], key, static_cast<uint32_t>(e));
    }
    const Tensor got = device::to_host(state);
    for (int64_t s = 0; s < num_slots; ++s) ASSERT_TRUE(test::bit_equal(got.select(s), want.select(s))) << "slot " << s;
  }
};

// Portable kernel sizes (N not in {64, 128, 256}, odd P, one group), the grid kernel, and from batch 64 the
// persistent kernels (at N = 128 the dynamic split for F32 / BF16).
TEST_P(OpsSsmStateDtype, SelectiveStateUpdateWritesTheRoundedStateExactly) {
  auto rng = test::Rng::for_test();
  const Dims shapes[] = {{3, 5, 1, 7}, {4, 8, 2, 16}, {5, 64, 1, 64}, {6, 64, 2, 128}, {2, 13, 2, 256}};
  for (const DType sd : kStateDtypes) {
    for (const DType act : acts()) {
      for (const Dims& d : shapes) {
        for (const int64_t batch : {1, 5}) check_ssu(rng, d, batch, act, sd, false);
      }
      check_ssu(rng, {4, 64, 2, 128}, 70, act, sd, false);
    }
  }
}

TEST_P(OpsSsmStateDtype, OutOfPlaceUpdateWritesTheRoundedStateExactly) {
  auto rng = test::Rng::for_test();
  for (const DType sd : kStateDtypes) {
    for (const DType act : acts()) {
      check_ssu(rng, {3, 5, 1, 7}, 4, act, sd, true);
      check_ssu(rng, {6, 64, 2, 128}, 5, act, sd, true);
      check_ssu(rng, {4, 64, 2, 128}, 66, act, sd, true);
    }
  }
}

// Lengths across the 128-token chunk grid; P = 64, N = 128 takes the tensor-core scan with BF16 activations on CUDA.
TEST_P(OpsSsmStateDtype, PrefillWritesTheRoundedFinalStateExactly) {
  auto rng = test::Rng::for_test();
  for (const DType sd : kStateDtypes) {
    for (const DType act : acts()) {
      check_prefill(rng, {4, 64, 2, 128}, {1, 17, 5, 130, 200}, act, sd, false);
      check_prefill(rng, {3, 5, 1, 7}, {2, 129, 9, 3}, act, sd, false);
      check_prefill(rng, {3, 5, 1, 7}, {2, 129, 9, 3}, act, sd, true);
    }
  }
}

// The same inputs give the same state bytes on a rerun (no hidden state in the bits: a counter, not a stream).
TEST_P(OpsSsmStateDtype, F16StateIsReproducibleAndDependsOnThePosition) {
  auto rng = test::Rng::for_test();
  const Dims d{4, 16, 2, 64};
  const int64_t batch = 3;
  const Tensor x = on_backend(rng.normal_tensor({batch, d.H, d.P})), B = on_backend(rng.normal_tensor({batch, d.G, d.N}));
  const Tensor C = on_backend(rng.normal_tensor({batch, d.G, d.N})), dt = on_backend(rng.normal_tensor({batch, d.H}));
  ops::SsmParams p;
  p.A_log = on_backend(rng.uniform_tensor({d.H}, 0.0f, 2.0f));
  p.D = on_backend(rng.normal_tensor({d.H}));
  p.dt_bias = on_backend(rng.normal_tensor({d.H}));
  p.state_seed = 99;
  const Tensor init = test::cast_to(rng.uniform_tensor({batch, d.H, d.P, d.N}, -2.0f, 2.0f), DType::kF16);
  const std::vector<int32_t> slots{0, 1, 2};
  auto run = [&](std::vector<int32_t> context) {
    const Tensor state = on_backend(init);
    ops::SsmParams q = p;
    q.context_lens = context;
    ops::selective_state_update(ctx(), output(DType::kF32, {batch, d.H, d.P}), x, dt, B, C, q, state, slots);
    return device::to_host(state);
  };
  const Tensor a = run({5, 6, 7}), b = run({5, 6, 7}), c = run({5, 6, 8});
  EXPECT_TRUE(test::bit_equal(a, b));
  EXPECT_TRUE(test::bit_equal(a.select(0), c.select(0)));
  EXPECT_FALSE(test::bit_equal(a.select(2), c.select(2))) << "another position must draw other bits";
}

// CUDA: the fused decode kernel (conv + state update + norm) and the three separate kernels write the same conv and
// SSM state bytes for 16-bit states (the same rounding keys), with pads and positions.
TEST_P(OpsSsmStateDtype, FusedDecodeWritesTheSameStatesAsTheThreeKernels) {
  if (!on_cuda()) GTEST_SKIP() << "the CPU composes the three ops (the fused kernel is CUDA's)";
  auto rng = test::Rng::for_test();
  const int64_t H = 8, P = 16, G = 2, N = 64, K = 4, Di = H * P, Cd = Di + 2 * G * N;
  for (const DType sd : {DType::kBF16, DType::kF16}) {
    for (const int64_t batch : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << "state " << dtype_name(sd) << " batch " << batch);
      const int64_t num_slots = batch + 3;
      const Tensor zxbcdt = on_backend(rng.normal_tensor({batch, Di + Cd + H}));
      const Tensor conv_w = on_backend(rng.normal_tensor({Cd, K}, 0.3f)), conv_b = on_backend(rng.normal_tensor({Cd}));
      const Tensor norm_w = on_backend(rng.normal_tensor({Di}));
      ops::SsmParams p;
      p.A_log = on_backend(rng.uniform_tensor({H}, 0.0f, 2.0f));
      p.D = on_backend(rng.normal_tensor({H}));
      p.dt_bias = on_backend(rng.normal_tensor({H}));
      p.state_seed = rng.engine()();
      std::vector<int32_t> context(static_cast<size_t>(batch));
      for (int32_t& c : context) c = static_cast<int32_t>(rng.integer(0, 9999));
      p.context_lens = context;
      const std::vector<int32_t> slots = batch == 1 ? std::vector<int32_t>{2} : std::vector<int32_t>{3, 0};
      const Tensor conv0 = rng.normal_tensor({num_slots, Cd, K - 1});
      const Tensor ssm0 = test::cast_to(rng.uniform_tensor({num_slots, H, P, N}, -2.0f, 2.0f), sd);
      auto run = [&](int64_t fused_rows) {
        ops::Context c = ctx();
        c.kernels.mamba_decode_fused_max_rows = fused_rows;
        const Tensor conv = on_backend(conv0), ssm = on_backend(ssm0);
        ops::mamba_decode_update(c, output(DType::kF32, {batch, Di}), zxbcdt, conv_w, conv_b, p, norm_w, G, 1e-5f,
                                 conv, ssm, slots);
        return std::pair{device::to_host(conv), device::to_host(ssm)};
      };
      const auto [conv_fused, ssm_fused] = run(64);
      const auto [conv_three, ssm_three] = run(0);
      EXPECT_TRUE(test::bit_equal(conv_fused, conv_three)) << "conv state";
      EXPECT_TRUE(test::bit_equal(ssm_fused, ssm_three)) << "SSM state";
      EXPECT_FALSE(test::bit_equal(ssm_fused, ssm0)) << "the step must write the state";
    }
  }
}

CHIMERA_INSTANTIATE_BACKENDS(OpsSsmStateDtype);

}  // namespace
}  // namespace chimera
