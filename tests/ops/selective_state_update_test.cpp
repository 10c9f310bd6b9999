// selective_state_update (the Mamba-2 decode step, docs/model.md 3.5) against a naive double oracle on every
// backend: odd and model head shapes, batches of 1 to 64 with pads and permuted slots, dt limits, misaligned
// state views; CUDA only: bf16 activations with f32 / bf16 / f16 state.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/mamba/selective_state_update.cuh"
#endif

namespace chimera {
namespace {

using test::BackendTest;

struct SsuShape {
  int64_t H, P, G, N;
};

struct SsuInputs {
  Tensor x, dt_raw, B, C;  // host F32: [batch, H, P], [batch, H], [batch, G, N], [batch, G, N]
  ops::SsmParams p;        // host F32 [H] each
};

SsuInputs make_inputs(test::Rng& rng, int64_t batch, const SsuShape& s) {
  SsuInputs in;
  in.x = rng.normal_tensor({batch, s.H, s.P});
  in.dt_raw = rng.normal_tensor({batch, s.H});
  in.B = rng.normal_tensor({batch, s.G, s.N}, 0.5f);
  in.C = rng.normal_tensor({batch, s.G, s.N}, 0.5f);
  in.p.A_log = rng.uniform_tensor({s.H}, 0.0f, 2.5f);  // A in [-12, -1]
  in.p.D = rng.normal_tensor({s.H});
  in.p.dt_bias = rng.uniform_tensor({s.H}, -4.0f, 1.0f);
  return in;
}

// A large random state without the cost of a normal distribution per element: uniform in [-2, 2].
Tensor random_state(test::Rng& rng, Shape shape) {
  Tensor t = Tensor::empty(DType::kF32, std::move(shape));
  uint64_t z = rng.engine()();
  for (int64_t i = 0; i < t.numel(); ++i) {
    z ^= z << 13, z ^= z >> 7, z ^= z << 17;  // xorshift64
    t.f32()[i] = static_cast<float>(static_cast<int64_t>(z >> 40) - (int64_t{1} << 23)) * (2.0f / (1 << 23));
  }
  return t;
}

// Naive decode step in double (docs/model.md 3.5 with the dt clamp of ops.h) on host F32 tensors; `state` is
// updated in place, pad rows of y are not written.
void naive_ssu(Tensor& y, const SsuInputs& in, Tensor& state, const std::vector<int32_t>& slots) {
  const int64_t H = in.x.dim(1), P = in.x.dim(2), G = in.B.dim(1), N = in.B.dim(2);
  for (size_t b = 0; b < slots.size(); ++b) {
    if (slots[b] < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      const double v = double(in.dt_raw.f32()[b * H + h]) + in.p.dt_bias.f32()[h];
      double dt = v > 20.0 ? v : std::log1p(std::exp(v));
      dt = std::clamp(dt, double(in.p.dt_min), double(in.p.dt_max));
      const double dA = std::exp(dt * -std::exp(double(in.p.A_log.f32()[h])));
      const float* Bv = in.B.f32() + (b * G + g) * N;
      const float* Cv = in.C.f32() + (b * G + g) * N;
      for (int64_t p = 0; p < P; ++p) {
        const double xv = in.x.f32()[(b * H + h) * P + p];
        float* st = state.f32() + ((slots[b] * H + h) * P + p) * N;
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) {
          const double s = st[n] * dA + dt * xv * Bv[n];
          st[n] = float(s);
          acc += s * Cv[n];
        }
        y.f32()[(b * H + h) * P + p] = float(acc + in.p.D.f32()[h] * xv);
      }
    }
  }
}

// Out-of-place slots over a pool of num_slots (>= 2 * batch): a random permutation gives the sources (slots) and,
// disjoint from them, the destinations (dst); every fifth sequence is a pad (slots -1, dst another sequence's source:
// ignored), and the last live sequence writes in place (dst == slots).
std::pair<std::vector<int32_t>, std::vector<int32_t>> oop_slots(test::Rng& rng, int64_t batch, int64_t num_slots) {
  std::vector<int32_t> perm(static_cast<size_t>(num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.engine());
  std::vector<int32_t> src(static_cast<size_t>(batch)), dst(static_cast<size_t>(batch));
  int64_t last_live = -1;
  for (int64_t b = 0; b < batch; ++b) {
    const bool pad = b % 5 == 4;
    src[b] = pad ? -1 : perm[b];
    dst[b] = pad ? perm[0] : perm[batch + b];
    if (!pad) last_live = b;
  }
  if (last_live > 0) dst[last_live] = src[last_live];
  return {src, dst};
}

class OpsSelectiveStateUpdate : public BackendTest {
 protected:
  // One step in place and one out of place (slots -> dst) from the same state `init` (host, the state dtype);
  // run(state, y, oop) launches the step on the backend under test. Checks the same y bits (pad rows still poisoned
  // in both), the in-place new state of slots[b] at dst[b] bit for bit, and that the sources (dst != slots) and every
  // other slot keep their bits. Returns the out-of-place y and state on the host.
  std::pair<Tensor, Tensor> check_oop(const std::function<void(const Tensor&, const Tensor&, bool)>& run,
                                      const Tensor& init, DType act, Shape y_shape, const std::vector<int32_t>& slots,
                                      const std::vector<int32_t>& dst) {
    const Tensor s_ip = on_backend(init), s_oop = on_backend(init);
    const Tensor y_ip = output(act, y_shape), y_oop = output(act, std::move(y_shape));
    run(s_ip, y_ip, false);
    run(s_oop, y_oop, true);
    const Tensor hy_ip = device::to_host(y_ip), hy_oop = device::to_host(y_oop);
    const Tensor h_ip = device::to_host(s_ip), h_oop = device::to_host(s_oop);
    EXPECT_TRUE(test::bit_equal(hy_oop, hy_ip)) << "y";
    std::vector<bool> written(static_cast<size_t>(init.dim(0)), false);
    for (size_t b = 0; b < slots.size(); ++b) {
      if (slots[b] < 0) continue;
      written[static_cast<size_t>(dst[b])] = true;
      EXPECT_TRUE(test::bit_equal(h_oop.select(dst[b]), h_ip.select(slots[b])))
          << "sequence " << b << ": slot " << slots[b] << " -> " << dst[b];
    }
    for (int64_t sl = 0; sl < init.dim(0); ++sl) {  // sources and unused slots keep their bits
      if (written[static_cast<size_t>(sl)]) continue;
      EXPECT_TRUE(test::bit_equal(h_oop.select(sl), init.select(sl))) << "slot " << sl;
    }
    return {hy_oop, h_oop};
  }

  // One decode step on the backend under test (activations in `act`, state in `state_dtype`, state given as
  // a device view `state` holding `state0`), checked against the oracle fed the same rounded inputs.
  void check_step(const SsuInputs& in, const std::vector<int32_t>& slots, const Tensor& state, DType act) {
    const DType sd = state.dtype();
    const Tensor x = on_backend(in.x, act), dt = on_backend(in.dt_raw, act);
    const Tensor B = on_backend(in.B, act), C = on_backend(in.C, act);
    ops::SsmParams p = in.p;
    p.A_log = on_backend(in.p.A_log);
    p.D = on_backend(in.p.D);
    p.dt_bias = on_backend(in.p.dt_bias);
    const Tensor state0 = host_f32(state);
    const Tensor y = output(act, in.x.shape());
    if (launcher_kernel_ == 0) {
      ops::selective_state_update(ctx(), y, x, dt, B, C, p, state, slots);
    } else {
      launch_variant(y, x, dt, B, C, p, state, slots);
    }

    SsuInputs rin = in;  // the oracle sees the rounded activations
    rin.x = host_f32(x), rin.dt_raw = host_f32(dt), rin.B = host_f32(B), rin.C = host_f32(C);
    Tensor want = Tensor::empty(DType::kF32, in.x.shape()), want_state = state0.clone();
    naive_ssu(want, rin, want_state, slots);

    Tensor got = host_f32(y);
    const int64_t row = in.x.dim(1) * in.x.dim(2);
    for (size_t b = 0; b < slots.size(); ++b) {  // pad rows untouched, then excluded from the comparison
      if (slots[b] >= 0) continue;
      for (int64_t i = int64_t(b) * row; i < int64_t(b + 1) * row; ++i) {
        ASSERT_TRUE(std::isnan(got.f32()[i])) << "pad row element " << i << " was written";
        got.f32()[i] = want.f32()[i] = 0.0f;
      }
    }
    const bool f32_act = act == DType::kF32;
    EXPECT_TRUE(test::nmse_close(got, want, f32_act ? test::kF32ReductionNmse : test::kBF16ReductionNmse,
                                 f32_act ? test::kF32Reduction : test::kBF16Elementwise));
    const Tensor got_state = host_f32(state);
    EXPECT_TRUE(test::nmse_close(got_state, want_state,
                                 sd == DType::kF32 ? test::kF32ReductionNmse : test::kBF16ReductionNmse,
                                 sd == DType::kF32 ? test::kF32Reduction : test::kBF16Elementwise));
    for (int64_t s = 0; s < state.dim(0); ++s) {  // slots no sequence uses keep their bits
      if (std::find(slots.begin(), slots.end(), static_cast<int32_t>(s)) == slots.end()) {
        ASSERT_TRUE(test::bit_equal(got_state.select(s), state0.select(s))) << "slot " << s;
      }
    }
  }

  // CUDA launcher-level variant (SsuKernel as int, 0 = through ops::).
  int launcher_kernel_ = 0, persist_warps_ = 0;
#ifdef CHIMERA_HAVE_CUDA
  // kPersistent's work split (launch_variant only).
  cuda::SsuSplit split_ = cuda::SsuSplit::kEqualWarps;
  int dynamic_chunk_ = 0;

  // One step's inputs on the device (bf16 activations, fp32 parameters) for the launcher-level bit-equality tests.
  struct DeviceStep {
    Tensor x, dt, B, C, A_log, D, dt_bias, slots;
    SsuShape s;
    int64_t batch;
  };
  DeviceStep device_step(const SsuInputs& in, const SsuShape& s, int64_t batch, const std::vector<int32_t>& slot_ids) {
    return DeviceStep{on_backend(in.x, DType::kBF16),      on_backend(in.dt_raw, DType::kBF16),
                      on_backend(in.B, DType::kBF16),      on_backend(in.C, DType::kBF16),
                      on_backend(in.p.A_log),              on_backend(in.p.D),
                      on_backend(in.p.dt_bias),            on_backend(Tensor::from_i32({batch}, slot_ids)),
                      s,                                   batch};
  }
  // The launcher's params for one step of `d` into y and state (kernel choice left at its defaults).
  static cuda::SsuParams step_params(const DeviceStep& d, const Tensor& y, const Tensor& state) {
    cuda::SsuParams p;
    p.x = d.x.data(), p.dt_raw = d.dt.data(), p.B = d.B.data(), p.C = d.C.data(), p.y = y.data();
    p.state = state.data(), p.slots = d.slots.i32();
    p.A_log = d.A_log.data(), p.D = d.D.data(), p.dt_bias = d.dt_bias.data();
    p.act = DType::kBF16, p.state_dtype = state.dtype();
    p.dt_min = 0.0f, p.dt_max = INFINITY;
    p.batch = int(d.batch), p.H = int(d.s.H), p.P = int(d.s.P), p.N = int(d.s.N), p.G = int(d.s.G);
    return p;
  }
#endif

  void launch_variant(const Tensor& y, const Tensor& x, const Tensor& dt, const Tensor& B, const Tensor& C,
                      const ops::SsmParams& sp, const Tensor& state, const std::vector<int32_t>& slot_ids) {
#ifdef CHIMERA_HAVE_CUDA
    const Tensor slots = on_backend(Tensor::from_i32({int64_t(slot_ids.size())}, slot_ids));
    cuda::SsuParams p;
    p.x = x.data(), p.dt_raw = dt.data(), p.B = B.data(), p.C = C.data(), p.y = y.data();
    p.state = state.data(), p.slots = slots.i32();
    p.A_log = sp.A_log.data(), p.D = sp.D.data(), p.dt_bias = sp.dt_bias.data();
    p.act = x.dtype(), p.state_dtype = state.dtype();
    p.a_log_dtype = sp.A_log.dtype(), p.d_dtype = sp.D.dtype(), p.dt_bias_dtype = sp.dt_bias.dtype();
    p.dt_min = sp.dt_min, p.dt_max = sp.dt_max;
    p.batch = int(x.dim(0)), p.H = int(x.dim(1)), p.P = int(x.dim(2)), p.G = int(B.dim(1)), p.N = int(B.dim(2));
    p.kernel = static_cast<cuda::SsuKernel>(launcher_kernel_);
    p.persist_warps = persist_warps_;
    p.split = split_, p.dynamic_chunk = dynamic_chunk_;
    cuda::launch_selective_state_update(p, nullptr);
    device::synchronize(Device::kCuda);
#else
    (void)y, (void)x, (void)dt, (void)B, (void)C, (void)sp, (void)state, (void)slot_ids;
    FAIL() << "launcher variants are CUDA-only";
#endif
  }

  void check_random(test::Rng& rng, const SsuShape& s, int64_t batch, DType act, DType state_dtype) {
    SCOPED_TRACE(::testing::Message() << "H=" << s.H << " P=" << s.P << " G=" << s.G << " N=" << s.N
                                      << " batch=" << batch << " act=" << dtype_name(act)
                                      << " state=" << dtype_name(state_dtype));
    const SsuInputs in = make_inputs(rng, batch, s);
    const int64_t num_slots = batch + 3;
    const Tensor state = on_backend(random_state(rng, {num_slots, s.H, s.P, s.N}), state_dtype);
    check_step(in, test::batch_slots(rng, batch, num_slots), state, act);
  }
};

// Odd shapes (portable kernel for N not in {64, 128, 256}), odd head counts, a single group, P = 80.
TEST_P(OpsSelectiveStateUpdate, OddShapesMatchNaive) {
  auto rng = test::Rng::for_test();
  const SsuShape shapes[] = {{3, 5, 1, 7}, {4, 8, 2, 16}, {8, 4, 8, 3}, {6, 16, 2, 32},
                             {5, 64, 1, 64}, {3, 80, 3, 128}, {2, 13, 2, 256}};
  for (const SsuShape& s : shapes) {
    for (int64_t batch : {1, 3, 17}) check_random(rng, s, batch, DType::kF32, DType::kF32);
  }
}

// Nemotron 3 Nano (H = 64) and Super (H = 128) heads: P = 64, N = 128, G = 8 (and G = 1, 2).
TEST_P(OpsSelectiveStateUpdate, ModelHeadShapesMatchNaive) {
  auto rng = test::Rng::for_test();
  check_random(rng, {64, 64, 8, 128}, 1, DType::kF32, DType::kF32);
  check_random(rng, {64, 64, 8, 128}, 9, DType::kF32, DType::kF32);
  check_random(rng, {128, 64, 8, 128}, 3, DType::kF32, DType::kF32);
  check_random(rng, {128, 64, 2, 128}, 2, DType::kF32, DType::kF32);
  check_random(rng, {64, 64, 1, 128}, 2, DType::kF32, DType::kF32);
  if (on_cuda()) {  // the full batch on the GPU only (the host oracle is the slow part)
    check_random(rng, {64, 64, 8, 128}, 64, DType::kF32, DType::kF32);
  }
}

TEST_P(OpsSelectiveStateUpdate, DtLimitsClamp) {
  auto rng = test::Rng::for_test();
  SsuInputs in = make_inputs(rng, 6, {4, 64, 2, 128});
  in.p.dt_min = 0.02f;
  in.p.dt_max = 0.08f;
  const Tensor state = on_backend(random_state(rng, {8, 4, 64, 128}));
  check_step(in, {7, 0, 3, -1, 5, 2}, state, DType::kF32);
}

// Ten decode steps in a row on the same slots: errors must not accumulate beyond fp32 rounding.
TEST_P(OpsSelectiveStateUpdate, RepeatedStepsMatchNaive) {
  auto rng = test::Rng::for_test();
  const SsuShape s{8, 64, 2, 128};
  const std::vector<int32_t> slots = {3, 1, -1, 0};
  const Tensor state = on_backend(random_state(rng, {5, s.H, s.P, s.N}));
  for (int step = 0; step < 10; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    check_step(make_inputs(rng, 4, s), slots, state, DType::kF32);
  }
}

// A state view that is not 16-byte aligned (CUDA: the portable kernel) gives the same results.
TEST_P(OpsSelectiveStateUpdate, MisalignedStateViewMatchesNaive) {
  auto rng = test::Rng::for_test();
  const SsuShape s{4, 64, 2, 128};
  const Tensor host = random_state(rng, {4 * s.H * s.P * s.N + 1});
  const Tensor state = on_backend(host).rows(1, host.numel()).reshape({4, s.H, s.P, s.N});
  check_step(make_inputs(rng, 3, s), {2, 0, -1}, state, DType::kF32);
}

// Out of place through ops:: (every backend): the in-place bits at the destination slots, sources and unused slots
// untouched, pads skipped whatever their destination, and the naive oracle's y and new state (f32). CUDA: the
// portable (N = 7, misaligned) and fast kernels, grid and persistent (kAuto from batch 64).
TEST_P(OpsSelectiveStateUpdate, OutOfPlaceMatchesInPlaceAndNaive) {
  auto rng = test::Rng::for_test();
  struct Case {
    SsuShape s;
    int64_t batch;
  };
  std::vector<Case> cases = {{{3, 5, 1, 7}, 4}, {{4, 64, 2, 128}, 6}, {{64, 64, 8, 128}, 9}, {{2, 13, 2, 256}, 3}};
  if (on_cuda()) cases.push_back({{64, 64, 8, 128}, 64});  // the persistent kernel (kAuto), Nano heads
  for (const Case& cs : cases) {
    const SsuShape& s = cs.s;
    SCOPED_TRACE(::testing::Message() << "H=" << s.H << " P=" << s.P << " G=" << s.G << " N=" << s.N
                                      << " batch=" << cs.batch);
    const SsuInputs in = make_inputs(rng, cs.batch, s);
    const auto ids = oop_slots(rng, cs.batch, 2 * cs.batch + 3);
    const std::vector<int32_t>& slots = ids.first;
    const std::vector<int32_t>& dst = ids.second;
    const Tensor init = random_state(rng, {2 * cs.batch + 3, s.H, s.P, s.N});
    const Tensor x = on_backend(in.x), dt = on_backend(in.dt_raw), B = on_backend(in.B), C = on_backend(in.C);
    ops::SsmParams p = in.p;
    p.A_log = on_backend(in.p.A_log), p.D = on_backend(in.p.D), p.dt_bias = on_backend(in.p.dt_bias);
    const auto [y, state] = check_oop(
        [&](const Tensor& st, const Tensor& out, bool oop) {
          if (oop) {
            ops::selective_state_update(ctx(), out, x, dt, B, C, p, st, slots, dst);
          } else {
            ops::selective_state_update(ctx(), out, x, dt, B, C, p, st, slots);
          }
        },
        init, DType::kF32, in.x.shape(), slots, dst);
    Tensor want = Tensor::empty(DType::kF32, in.x.shape()), want_state = init.clone();
    naive_ssu(want, in, want_state, slots);
    Tensor got = y.clone();
    const int64_t row = s.H * s.P;
    for (size_t b = 0; b < slots.size(); ++b) {  // pad rows: untouched (checked as NaN), then excluded
      if (slots[b] >= 0) continue;
      for (int64_t i = int64_t(b) * row; i < int64_t(b + 1) * row; ++i) {
        ASSERT_TRUE(std::isnan(got.f32()[i])) << "pad row element " << i << " was written";
        got.f32()[i] = want.f32()[i] = 0.0f;
      }
    }
    EXPECT_TRUE(test::nmse_close(got, want, test::kF32ReductionNmse, test::kF32Reduction));
    for (size_t b = 0; b < slots.size(); ++b) {
      if (slots[b] < 0) continue;
      EXPECT_TRUE(test::nmse_close(state.select(dst[b]), want_state.select(slots[b]), test::kF32ReductionNmse,
                                   test::kF32Reduction))
          << "sequence " << b;
    }
  }
}

// A misaligned state view (CUDA: the portable kernel for N = 128) out of place: the in-place bits.
TEST_P(OpsSelectiveStateUpdate, OutOfPlaceMisalignedStateView) {
  auto rng = test::Rng::for_test();
  const SsuShape s{4, 64, 2, 128};
  const int64_t batch = 3, num_slots = 8;
  const SsuInputs in = make_inputs(rng, batch, s);
  const Tensor host = random_state(rng, {num_slots * s.H * s.P * s.N + 1});
  const Tensor init = host.rows(1, host.numel()).clone().reshape({num_slots, s.H, s.P, s.N});
  const std::vector<int32_t> slots = {2, 0, -1}, dst = {5, 7, 0};
  const Tensor x = on_backend(in.x), dt = on_backend(in.dt_raw), B = on_backend(in.B), C = on_backend(in.C);
  ops::SsmParams p = in.p;
  p.A_log = on_backend(in.p.A_log), p.D = on_backend(in.p.D), p.dt_bias = on_backend(in.p.dt_bias);
  check_oop(
      [&](const Tensor& st, const Tensor& out, bool oop) {
        const Tensor buf = device::empty(st.device(), DType::kF32, {st.numel() + 1});
        const Tensor view = buf.rows(1, buf.numel()).reshape(st.shape());
        device::copy(view, st);
        if (oop) {
          ops::selective_state_update(ctx(), out, x, dt, B, C, p, view, slots, dst);
        } else {
          ops::selective_state_update(ctx(), out, x, dt, B, C, p, view, slots);
        }
        device::copy(st, view);
      },
      init, DType::kF32, in.x.shape(), slots, dst);
}

// ops:: rejects destinations that are out of range, shared, or another live sequence's source.
TEST_P(OpsSelectiveStateUpdate, OutOfPlaceRejectsBadDestinations) {
  auto rng = test::Rng::for_test();
  const SsuShape s{4, 8, 2, 16};
  const SsuInputs in = make_inputs(rng, 3, s);
  const Tensor x = on_backend(in.x), dt = on_backend(in.dt_raw), B = on_backend(in.B), C = on_backend(in.C);
  ops::SsmParams p = in.p;
  p.A_log = on_backend(in.p.A_log), p.D = on_backend(in.p.D), p.dt_bias = on_backend(in.p.dt_bias);
  const Tensor y = output(DType::kF32, in.x.shape()), state = on_backend(random_state(rng, {6, s.H, s.P, s.N}));
  const std::vector<int32_t> slots = {0, 1, -1};
  auto call = [&](std::vector<int32_t> dst) {
    return [&, dst] { ops::selective_state_update(ctx(), y, x, dt, B, C, p, state, slots, dst); };
  };
  EXPECT_TRUE(test::throws_error(call({2, 6, 3}), ErrorKind::kRuntime, "dst slot 6 of sequence 1 is out of range"));
  EXPECT_TRUE(test::throws_error(call({-1, 3, 4}), ErrorKind::kRuntime, "dst slot -1 of sequence 0 is out of range"));
  EXPECT_TRUE(test::throws_error(call({3, 3, 4}), ErrorKind::kRuntime, "is the destination of more than one"));
  EXPECT_TRUE(test::throws_error(call({1, 3, 4}), ErrorKind::kRuntime, "is the source slot of sequence 1"));
  EXPECT_TRUE(test::throws_error(call({2, 3}), ErrorKind::kRuntime, "2 dst_slots for 3 slots"));
  // Accepted: a pad's destination is ignored (here another sequence's source), and a row may update in place.
  ops::selective_state_update(ctx(), y, x, dt, B, C, p, state, slots, std::vector<int32_t>{0, 4, 1});
}

// ---- CUDA only ---------------------------------------------------------------------------------------

TEST_P(OpsSelectiveStateUpdate, Bf16ActivationsEveryStateDtype) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are CUDA-only (the CPU reference is F32)";
  auto rng = test::Rng::for_test();
  for (DType sd : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t batch : {1, 9}) check_random(rng, {128, 64, 8, 128}, batch, DType::kBF16, sd);
    if (sd == DType::kBF16) check_random(rng, {64, 64, 8, 128}, 64, DType::kBF16, sd);  // Nano, batch 64
    check_random(rng, {5, 64, 1, 64}, 7, DType::kBF16, sd);   // N = 64 fast path, odd heads
    check_random(rng, {2, 13, 2, 256}, 3, DType::kBF16, sd);  // N = 256, P not a multiple of the row tile
    check_random(rng, {3, 5, 1, 7}, 4, DType::kF16, sd);      // portable kernel, f16 activations
  }
}

// Parameters (A_log, D, dt_bias) in bf16.
TEST_P(OpsSelectiveStateUpdate, Bf16ParametersMatchNaive) {
  if (!on_cuda()) GTEST_SKIP() << "parameter dtypes other than F32 are exercised on CUDA";
  auto rng = test::Rng::for_test();
  SsuInputs in = make_inputs(rng, 5, {16, 64, 4, 128});
  for (Tensor* t : {&in.p.A_log, &in.p.D, &in.p.dt_bias}) *t = test::cast_to(*t, DType::kBF16).to_f32();
  ops::SsmParams p = in.p;
  p.A_log = test::cast_to(in.p.A_log, DType::kBF16);
  p.D = test::cast_to(in.p.D, DType::kBF16);
  p.dt_bias = test::cast_to(in.p.dt_bias, DType::kBF16);
  const Tensor state = on_backend(random_state(rng, {6, 16, 64, 128}));
  const Tensor state0 = host_f32(state);
  const std::vector<int32_t> slots = {4, 0, 5, 2, -1};
  const Tensor x = on_backend(in.x), dt = on_backend(in.dt_raw), B = on_backend(in.B), C = on_backend(in.C);
  p.A_log = on_backend(p.A_log), p.D = on_backend(p.D), p.dt_bias = on_backend(p.dt_bias);
  const Tensor y = output(DType::kF32, in.x.shape());
  ops::selective_state_update(ctx(), y, x, dt, B, C, p, state, slots);
  Tensor want = Tensor::empty(DType::kF32, in.x.shape()), want_state = state0.clone();
  test::poison(want);
  naive_ssu(want, in, want_state, slots);
  const Tensor got = host_f32(y);
  for (int64_t i = 4 * 16 * 64; i < 5 * 16 * 64; ++i) got.f32()[i] = want.f32()[i] = 0.0f;  // the pad row
  EXPECT_TRUE(test::nmse_close(got, want, test::kF32ReductionNmse, test::kF32Reduction));
  EXPECT_TRUE(test::nmse_close(host_f32(state), want_state, test::kF32ReductionNmse, test::kF32Reduction));
}

TEST_P(OpsSelectiveStateUpdate, CudaRejectsMixedActivationDtypes) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA dispatch limits";
  auto rng = test::Rng::for_test();
  const SsuInputs in = make_inputs(rng, 2, {4, 8, 2, 16});
  ops::SsmParams p = in.p;
  p.A_log = on_backend(in.p.A_log), p.D = on_backend(in.p.D), p.dt_bias = on_backend(in.p.dt_bias);
  const Tensor x = on_backend(in.x, DType::kBF16), dt = on_backend(in.dt_raw, DType::kBF16);
  const Tensor B = on_backend(in.B), C = on_backend(in.C, DType::kBF16);
  const Tensor y = output(DType::kBF16, in.x.shape()), state = on_backend(random_state(rng, {2, 4, 8, 16}));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::selective_state_update(ctx(), y, x, dt, B, C, p, state, std::vector<int32_t>{0, 1}); },
      ErrorKind::kRuntime, "ops::selective_state_update: activations must share one dtype on CUDA"));
}

#ifdef CHIMERA_HAVE_CUDA
// The persistent kernel (4 KB units) against the oracle: N = 64 / 128 / 256, P not a multiple of the unit's rows
// (13, 80), G = 1 and G = H, batches 1 to 64 with pads (every fifth
// sequence) and permuted slots, every state dtype, bf16 and f32 activations, dt limits.
TEST_P(OpsSelectiveStateUpdate, PersistentKernelMatchesNaive) {
  if (!on_cuda()) GTEST_SKIP() << "launcher-level CUDA test";
  auto rng = test::Rng::for_test();
  {
    launcher_kernel_ = static_cast<int>(cuda::SsuKernel::kPersistent);
    for (DType sd : {DType::kF32, DType::kBF16, DType::kF16}) {
      check_random(rng, {128, 64, 8, 128}, 9, DType::kBF16, sd);  // Super heads
      check_random(rng, {5, 64, 1, 64}, 7, DType::kBF16, sd);     // N = 64, odd heads
      check_random(rng, {2, 13, 2, 256}, 3, DType::kBF16, sd);    // N = 256, P = 13
      check_random(rng, {3, 80, 3, 128}, 17, DType::kF32, sd);    // P = 80, G = H
      check_random(rng, {6, 16, 2, 128}, 1, DType::kF32, sd);     // one sequence: fewer units than warps
    }
    check_random(rng, {64, 64, 8, 128}, 64, DType::kBF16, DType::kBF16);  // Nano, batch 64
    for (int warps : {1, 3, 7}) {  // a few warps walking long runs across heads, groups and sequences (pads)
      persist_warps_ = warps;
      SCOPED_TRACE(::testing::Message() << "persist_warps=" << warps);
      check_random(rng, {16, 64, 4, 128}, 6, DType::kBF16, DType::kBF16);
      check_random(rng, {3, 13, 3, 256}, 11, DType::kF32, DType::kF32);
    }
    persist_warps_ = 0;
  }
  SsuInputs in = make_inputs(rng, 6, {4, 64, 2, 128});
  in.p.dt_min = 0.02f;
  in.p.dt_max = 0.08f;
  launcher_kernel_ = static_cast<int>(cuda::SsuKernel::kPersistent);
  check_step(in, {7, 0, 3, -1, 5, 2}, on_backend(random_state(rng, {8, 4, 64, 128})), DType::kF32);
}

// The fast kernel's row tilings (4, 8, 16 rows per warp; 0 = the occupancy rule) and the persistent kernel compute every element the same way: identical bits, for an fp32 and a bf16 state.
TEST_P(OpsSelectiveStateUpdate, EveryRowTilingGivesTheSameBits) {
  if (!on_cuda()) GTEST_SKIP() << "launcher-level CUDA test";
  auto rng = test::Rng::for_test();
  const SsuShape s{16, 64, 8, 128};
  const int64_t batch = 5;
  const DeviceStep d = device_step(make_inputs(rng, batch, s), s, batch, {6, 0, -1, 3, 5});
  const Tensor state0 = random_state(rng, {7, s.H, s.P, s.N});
  for (DType sd : {DType::kF32, DType::kBF16}) {
    Tensor ref_y, ref_state;
    // rows 4, 8, 16 and 0 (the rule) for the grid kernel; -1: the persistent kernel.
    for (int rows : {0, 4, 8, 16, -1}) {
      SCOPED_TRACE(::testing::Message() << "state=" << dtype_name(sd) << " rows_per_warp=" << rows);
      const Tensor state = on_backend(state0, sd);
      const Tensor y = output(DType::kBF16, {batch, s.H, s.P});
      cuda::SsuParams p = step_params(d, y, state);
      p.rows_per_warp = std::max(rows, 0);
      if (rows < 0) p.kernel = cuda::SsuKernel::kPersistent;
      cuda::launch_selective_state_update(p, nullptr);
      device::synchronize(Device::kCuda);
      const Tensor hy = device::to_host(y), hs = device::to_host(state);
      if (rows == 0) {
        ref_y = hy, ref_state = hs;
      } else {
        EXPECT_TRUE(test::bit_equal(hy, ref_y));
        EXPECT_TRUE(test::bit_equal(hs, ref_state));
      }
    }
  }
}

// kAuto from batch 64 (N = 128, f32 / bf16 state): the persistent kernel with the dynamic split (chunks of 4
// units), the same bits as the persistent kernel's static split, on Nano's heads with pads and permuted slots, and
// repeated calls (each starts from the counters the previous one reset).
TEST_P(OpsSelectiveStateUpdate, AutoAtBatch64EqualsTheStaticSplit) {
  if (!on_cuda()) GTEST_SKIP() << "launcher-level CUDA test";
  auto rng = test::Rng::for_test();
  const SsuShape s{64, 64, 8, 128};
  const int64_t batch = 64, num_slots = 70;
  const DeviceStep d = device_step(make_inputs(rng, batch, s), s, batch, test::batch_slots(rng, batch, num_slots));
  const Tensor state0 = random_state(rng, {num_slots, s.H, s.P, s.N});
  for (DType sd : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(::testing::Message() << "state=" << dtype_name(sd));
    auto run = [&](cuda::SsuKernel kernel, int calls) {
      const Tensor state = on_backend(state0, sd);
      const Tensor y = output(DType::kBF16, {batch, s.H, s.P});
      for (int c = 0; c < calls; ++c) {
        cuda::SsuParams p = step_params(d, y, state);
        p.kernel = kernel;
        cuda::launch_selective_state_update(p, nullptr);
      }
      device::synchronize(Device::kCuda);
      return std::make_pair(device::to_host(y), device::to_host(state));
    };
    const auto [ref_y, ref_state] = run(cuda::SsuKernel::kPersistent, 3);
    const auto [got_y, got_state] = run(cuda::SsuKernel::kAuto, 3);
    EXPECT_TRUE(test::bit_equal(got_y, ref_y));
    EXPECT_TRUE(test::bit_equal(got_state, ref_state));
  }
}

// The persistent kernel's dynamic split changes only the schedule: the same bits as the static split for every
// state dtype, at N = 64 and 128, on P not a multiple of the unit's rows
// (13, 36), one group and G = H, pads and permuted slots, chunks of 1 to 5 units, few warps walking long runs
// (many grabs).
TEST_P(OpsSelectiveStateUpdate, DynamicSplitGivesTheSameBits) {
  if (!on_cuda()) GTEST_SKIP() << "launcher-level CUDA test";
  auto rng = test::Rng::for_test();
  struct Variant {
    int chunk = 0, warps = 0;
  };
  const Variant variants[] = {{0, 0}, {1, 0}, {3, 0}, {4, 0}, {2, 3}, {5, 5}};
  const SsuShape shapes[] = {{16, 64, 8, 128}, {5, 36, 1, 128}, {3, 13, 3, 128}, {4, 36, 2, 64}};
  for (const SsuShape& s : shapes) {
    const int64_t batch = 6;
    const DeviceStep d = device_step(make_inputs(rng, batch, s), s, batch, {6, 0, -1, 3, 5, 1});
    const Tensor state0 = random_state(rng, {7, s.H, s.P, s.N});
    for (DType sd : {DType::kF32, DType::kBF16, DType::kF16}) {
      {
        // One step from state0 with `v` (nullptr: the static split); y and the state to the host.
        auto run = [&](const Variant* v) {
          const Tensor state = on_backend(state0, sd);
          const Tensor y = output(DType::kBF16, {batch, s.H, s.P});
          cuda::SsuParams p = step_params(d, y, state);
          p.kernel = cuda::SsuKernel::kPersistent;
          if (v != nullptr) p.split = cuda::SsuSplit::kDynamic, p.dynamic_chunk = v->chunk, p.persist_warps = v->warps;
          cuda::launch_selective_state_update(p, nullptr);
          device::synchronize(Device::kCuda);
          return std::make_pair(device::to_host(y), device::to_host(state));
        };
        const auto [ref_y, ref_state] = run(nullptr);
        for (const Variant& v : variants) {
          SCOPED_TRACE(::testing::Message() << "H=" << s.H << " P=" << s.P << " G=" << s.G << " N=" << s.N
                                            << " state=" << dtype_name(sd) << " chunk=" << v.chunk
                                            << " warps=" << v.warps);
          const auto [got_y, got_state] = run(&v);
          EXPECT_TRUE(test::bit_equal(got_y, ref_y));
          EXPECT_TRUE(test::bit_equal(got_state, ref_state));
        }
      }
    }
  }
}

// The dynamic split against the oracle (f32 and bf16 activations), and its counter: ten steps in a row on one
// state, each starting from a reset counter (a counter left behind would skip units).
TEST_P(OpsSelectiveStateUpdate, DynamicSplitMatchesNaive) {
  if (!on_cuda()) GTEST_SKIP() << "launcher-level CUDA test";
  auto rng = test::Rng::for_test();
  launcher_kernel_ = static_cast<int>(cuda::SsuKernel::kPersistent);
  split_ = cuda::SsuSplit::kDynamic;
  {
    for (DType sd : {DType::kF32, DType::kBF16}) {
      check_random(rng, {128, 64, 8, 128}, 9, DType::kBF16, sd);  // Super heads
      check_random(rng, {3, 36, 3, 128}, 17, DType::kF32, sd);    // P = 36, G = H
      check_random(rng, {6, 16, 2, 128}, 1, DType::kF32, sd);     // one sequence: fewer units than warps
    }
    persist_warps_ = 3;
    check_random(rng, {16, 64, 4, 128}, 6, DType::kBF16, DType::kBF16);
    persist_warps_ = 0;
  }
  const SsuShape s{8, 64, 2, 128};
  const Tensor state = on_backend(random_state(rng, {5, s.H, s.P, s.N}));
  for (int step = 0; step < 10; ++step) {
    SCOPED_TRACE(::testing::Message() << "dynamic step " << step);
    dynamic_chunk_ = 1 + step % 3;
    check_step(make_inputs(rng, 4, s), {3, 1, -1, 0}, state, DType::kF32);
  }
  split_ = cuda::SsuSplit::kEqualWarps, dynamic_chunk_ = 0, launcher_kernel_ = 0;
}

// Out of place in every launcher variant the tests above force (grid row tilings, the persistent kernel's static
// and dynamic splits and few warps, the portable kernel
// for N = 7), every state dtype: the in-place run's y and new state bits (same variant), sources and unused slots
// untouched, pads skipped; N = 64 / 128 / 256, P = 13, permuted slots.
TEST_P(OpsSelectiveStateUpdate, OutOfPlaceEveryKernelGivesTheInPlaceBits) {
  if (!on_cuda()) GTEST_SKIP() << "launcher-level CUDA test";
  auto rng = test::Rng::for_test();
  struct Variant {
    const char* name;
    cuda::SsuKernel kernel = cuda::SsuKernel::kAuto;
    int rows = 0, chunk = 0, warps = 0;
    bool dynamic = false;
  };
  const Variant variants[] = {
      {"grid-auto", cuda::SsuKernel::kGrid},
      {"grid-rpw4", cuda::SsuKernel::kGrid, 4},
      {"grid-rpw8", cuda::SsuKernel::kGrid, 8},
      {"grid-rpw16", cuda::SsuKernel::kGrid, 16},
      {"persist", cuda::SsuKernel::kPersistent},
      {"persist-w3", cuda::SsuKernel::kPersistent, 0, 0, 3},
      {"persist-dyn4", cuda::SsuKernel::kPersistent, 0, 4, 0, true},
      {"persist-dyn1-w3", cuda::SsuKernel::kPersistent, 0, 1, 3, true},
      {"auto", cuda::SsuKernel::kAuto},
  };
  const SsuShape shapes[] = {{16, 64, 8, 128}, {5, 64, 1, 64}, {2, 13, 2, 256}, {3, 5, 1, 7}};
  for (const SsuShape& s : shapes) {
    const int64_t batch = 7, num_slots = 2 * batch + 2;
    const auto ids = oop_slots(rng, batch, num_slots);
    const std::vector<int32_t>& slots = ids.first;
    const std::vector<int32_t>& dst = ids.second;
    const DeviceStep d = device_step(make_inputs(rng, batch, s), s, batch, slots);
    const Tensor dst_dev = on_backend(Tensor::from_i32({batch}, dst));
    const Tensor init_f32 = random_state(rng, {num_slots, s.H, s.P, s.N});
    for (DType sd : {DType::kF32, DType::kBF16, DType::kF16}) {
      const Tensor init = test::cast_to(init_f32, sd);
      for (const Variant& v : variants) {
        SCOPED_TRACE(::testing::Message() << "H=" << s.H << " P=" << s.P << " G=" << s.G << " N=" << s.N
                                          << " state=" << dtype_name(sd) << " variant=" << v.name);
        check_oop(
            [&](const Tensor& st, const Tensor& y, bool oop) {
              cuda::SsuParams p = step_params(d, y, st);
              p.kernel = v.kernel, p.rows_per_warp = v.rows;
              p.persist_warps = v.warps;
              if (v.dynamic) p.split = cuda::SsuSplit::kDynamic, p.dynamic_chunk = v.chunk;
              if (oop) p.dst_slots = dst_dev.i32();
              cuda::launch_selective_state_update(p, nullptr);
              device::synchronize(Device::kCuda);
            },
            init, DType::kBF16, {batch, s.H, s.P}, slots, dst);
      }
    }
  }
}
#endif

CHIMERA_INSTANTIATE_BACKENDS(OpsSelectiveStateUpdate);

}  // namespace
}  // namespace chimera
