// mamba_decode_update (conv update + selective state update + gated norm, one token per sequence) against
//   (a) the three ops composed on the same backend: conv and SSM state bit-identical, out within the activation
//       dtype's elementwise bound (only the norm's sum of squares is added in another order);
//   (b) the CPU reference (the three CPU ops in fp32) fed the same rounded inputs: reduction bounds.
// Awkward sizes: batch 1, 3, 17, 64; n_groups 1, 2, 8; 1..16 heads per group; head_dim 64, 13, 80; K 2..4; N 64,
// 128, 256, 16, 32 and a size the fused kernel does not take (N 8: the op composes the three ops); permuted slots with
// pads and unused slots; f32 / bf16 activations and states (16-bit on CUDA only: the CPU reference is F32).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/mamba/mamba_decode_fused.cuh"
#endif

namespace chimera {
namespace {

using test::BackendTest;

struct Dims {
  int64_t H, P, G, N, K;
  int64_t Di() const { return H * P; }
  int64_t Cd() const { return H * P + 2 * G * N; }
  int64_t width() const { return Di() + Cd() + H; }
};

// Host F32 inputs of one step.
struct Inputs {
  Tensor zxbcdt, conv_w, conv_b, norm_w, conv_state, ssm_state;
  ops::SsmParams p;
};

Inputs make_inputs(test::Rng& rng, const Dims& d, int64_t batch, int64_t num_slots) {
  Inputs in;
  in.zxbcdt = rng.normal_tensor({batch, d.width()});
  in.conv_w = rng.normal_tensor({d.Cd(), 1, d.K}, 0.5f);
  in.conv_b = rng.normal_tensor({d.Cd()}, 0.2f);
  in.norm_w = rng.uniform_tensor({d.Di()}, 0.8f, 1.2f);
  in.conv_state = rng.normal_tensor({num_slots, d.Cd(), d.K - 1});
  in.ssm_state = rng.uniform_tensor({num_slots, d.H, d.P, d.N}, -2.0f, 2.0f);
  in.p.A_log = rng.uniform_tensor({d.H}, 0.0f, 2.5f);
  in.p.D = rng.normal_tensor({d.H});
  in.p.dt_bias = rng.uniform_tensor({d.H}, -4.0f, 1.0f);
  return in;
}

// Tensors of one step on one device: activations in `act`, conv state in `act` (as StateCache), SSM state in
// `sd`, conv / norm weights in `weight_dtype`, the [H] parameters F32 (as the model keeps them).
struct OnDevice {
  Tensor zxbcdt, conv_w, conv_b, norm_w, conv_state, ssm_state;
  ops::SsmParams p;
};

OnDevice place(const Inputs& in, Device dev, DType act, DType sd, DType weight_dtype) {
  OnDevice o;
  o.zxbcdt = device::to_device(in.zxbcdt, dev, act);
  o.conv_w = device::to_device(in.conv_w, dev, weight_dtype);
  o.conv_b = device::to_device(in.conv_b, dev, weight_dtype);
  o.norm_w = device::to_device(in.norm_w, dev, weight_dtype);
  o.conv_state = device::to_device(in.conv_state, dev, act);
  o.ssm_state = device::to_device(in.ssm_state, dev, sd);
  o.p = in.p;
  o.p.A_log = device::to_device(in.p.A_log, dev);
  o.p.D = device::to_device(in.p.D, dev);
  o.p.dt_bias = device::to_device(in.p.dt_bias, dev);
  return o;
}

// Host F32 copies of a placement (what the CPU reference is fed: the values the device tensors hold).
Inputs host_values(const OnDevice& o) {
  Inputs in;
  in.zxbcdt = device::to_host_f32(o.zxbcdt);
  in.conv_w = device::to_host_f32(o.conv_w);
  in.conv_b = device::to_host_f32(o.conv_b);
  in.norm_w = device::to_host_f32(o.norm_w);
  in.conv_state = device::to_host_f32(o.conv_state);
  in.ssm_state = device::to_host_f32(o.ssm_state);
  in.p = o.p;
  in.p.A_log = device::to_host_f32(o.p.A_log);
  in.p.D = device::to_host_f32(o.p.D);
  in.p.dt_bias = device::to_host_f32(o.p.dt_bias);
  return in;
}

// The model's unfused decode path, op by op (column splits as copies).
void three_ops(const ops::Context& ctx, const Tensor& out, const OnDevice& o, const Dims& d,
               const std::vector<int32_t>& slots) {
  const int64_t Bn = o.zxbcdt.dim(0), Di = d.Di(), Cd = d.Cd(), GN = d.G * d.N;
  const auto tmp = [&](Shape s) { return device::empty(ctx.device, o.zxbcdt.dtype(), std::move(s)); };
  const Tensor z = tmp({Bn, Di}), xbc = tmp({Bn, Cd}), dt = tmp({Bn, d.H}), xbc_act = tmp({Bn, Cd});
  ops::copy_columns(ctx, z, o.zxbcdt, 0);
  ops::copy_columns(ctx, xbc, o.zxbcdt, Di);
  ops::copy_columns(ctx, dt, o.zxbcdt, Di + Cd);
  ops::causal_conv1d_update(ctx, xbc_act, xbc, o.conv_w, o.conv_b, o.conv_state, slots, true);
  const Tensor x = tmp({Bn, Di}), B = tmp({Bn, GN}), C = tmp({Bn, GN}), y = tmp({Bn, d.H, d.P});
  ops::copy_columns(ctx, x, xbc_act, 0);
  ops::copy_columns(ctx, B, xbc_act, Di);
  ops::copy_columns(ctx, C, xbc_act, Di + GN);
  ops::selective_state_update(ctx, y, x.reshape({Bn, d.H, d.P}), dt, B.reshape({Bn, d.G, d.N}),
                              C.reshape({Bn, d.G, d.N}), o.p, o.ssm_state, slots);
  ops::gated_rms_norm(ctx, out, y.reshape({Bn, Di}), z, o.norm_w, d.G, 1e-5f);
}

// Zeroes the pad rows of host F32 tensors (excluded from comparisons).
void zero_pad_rows(const std::vector<int32_t>& slots, std::initializer_list<Tensor*> ts) {
  for (Tensor* t : ts) {
    const int64_t row = t->numel() / t->dim(0);
    for (size_t b = 0; b < slots.size(); ++b) {
      if (slots[b] < 0) std::fill_n(t->f32() + int64_t(b) * row, row, 0.0f);
    }
  }
}

class OpsMambaDecodeUpdate : public BackendTest {
 protected:
  // Did (or would) the fused kernel run? On the CPU, and for sizes CUDA composes, pad rows are handled by the
  // composition (CPU: untouched; CUDA: unspecified).
  bool fused(const OnDevice& o, const Dims& d) const {
#ifdef CHIMERA_HAVE_CUDA
    return on_cuda() && cuda::mamba_decode_fusable(o.zxbcdt, o.conv_w, o.conv_state, o.ssm_state, d.G);
#else
    (void)o, (void)d;
    return false;
#endif
  }

  void check(test::Rng& rng, const Dims& d, int64_t batch, DType act, DType sd, int steps = 1) {
    SCOPED_TRACE(::testing::Message() << "H=" << d.H << " P=" << d.P << " G=" << d.G << " N=" << d.N << " K=" << d.K
                                      << " batch=" << batch << " act=" << dtype_name(act)
                                      << " state=" << dtype_name(sd));
    const int64_t num_slots = batch + 3;
    const std::vector<int32_t> slots = test::batch_slots(rng, batch, num_slots);
    Inputs in = make_inputs(rng, d, batch, num_slots);
    const DType wd = act == DType::kF32 ? DType::kF32 : act;  // the model uploads conv / norm weights in act
    OnDevice fz = place(in, GetParam(), act, sd, wd);          // the op under test
    OnDevice ref = place(in, GetParam(), act, sd, wd);         // the three ops, same backend
    const Tensor cs0 = device::to_host(fz.conv_state), ss0 = device::to_host(fz.ssm_state);
    for (int step = 0; step < steps; ++step) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      if (step > 0) {  // a new token, same states
        const Tensor zx = device::to_device(rng.normal_tensor({batch, d.width()}), GetParam(), act);
        fz.zxbcdt = zx, ref.zxbcdt = zx;
      }
      const Inputs host_in = host_values(fz);  // before the step: the CPU reference's inputs
      const Tensor out = output(act, {batch, d.Di()}), out_ref = output(act, {batch, d.Di()});
      // Odd steps load the states before the kernel's PDL wait (prefetch_states; the inputs came by copies, so the
      // states are settled): the same bits are expected either way.
      // The kernel under test at every batch size (the plan takes it only for the smallest batches).
      ops::Context fused_ctx = ctx();
      fused_ctx.kernels.mamba_decode_fused_max_rows = batch;
      ops::mamba_decode_update(fused_ctx, out, fz.zxbcdt, fz.conv_w, fz.conv_b, fz.p, fz.norm_w, d.G, 1e-5f,
                               fz.conv_state, fz.ssm_state, slots, /*prefetch_states=*/step % 2 == 1);
      three_ops(ctx(), out_ref, ref, d, slots);

      // (a) same backend, three ops: states bit-identical, out within an ulp; pad rows never written.
      EXPECT_TRUE(test::bit_equal(device::to_host(fz.conv_state), device::to_host(ref.conv_state))) << "conv state";
      EXPECT_TRUE(test::bit_equal(device::to_host(fz.ssm_state), device::to_host(ref.ssm_state))) << "ssm state";
      Tensor got = host_f32(out), want = host_f32(out_ref);
      if (!on_cuda() || fused(fz, d)) {
        for (size_t b = 0; b < slots.size(); ++b) {
          for (int64_t i = 0; slots[b] < 0 && i < d.Di(); ++i) {
            ASSERT_TRUE(std::isnan(got.f32()[int64_t(b) * d.Di() + i])) << "pad row " << b << " was written";
          }
        }
      }
      zero_pad_rows(slots, {&got, &want});
      EXPECT_TRUE(test::all_close(got, want, act == DType::kF32 ? test::kF32Elementwise : test::kBF16Elementwise));

      // (b) the CPU reference on the same (rounded) values.
      const ops::Context cpu{Device::kCpu, nullptr};
      OnDevice h;
      h.zxbcdt = host_in.zxbcdt, h.conv_w = host_in.conv_w, h.conv_b = host_in.conv_b, h.norm_w = host_in.norm_w;
      h.conv_state = host_in.conv_state, h.ssm_state = host_in.ssm_state, h.p = host_in.p;
      Tensor want_cpu = Tensor::empty(DType::kF32, {batch, d.Di()});
      three_ops(cpu, want_cpu, h, d, slots);
      zero_pad_rows(slots, {&want_cpu});
      const bool f32 = act == DType::kF32 && sd == DType::kF32;
      const double nmse = f32 ? test::kF32ReductionNmse : test::kBF16ReductionNmse;
      const test::Tolerance tol = f32 ? test::kF32Reduction : test::kBF16Reduction;
      EXPECT_TRUE(test::nmse_close(got, want_cpu, nmse, tol)) << "out vs the CPU reference";
      EXPECT_TRUE(test::nmse_close(host_f32(fz.ssm_state), h.ssm_state, nmse, tol)) << "ssm state vs CPU";
      EXPECT_TRUE(test::nmse_close(host_f32(fz.conv_state), h.conv_state, nmse, tol)) << "conv state vs CPU";
    }
    // Slots no sequence uses (unused or held by a pad) keep their bits.
    const Tensor cs = device::to_host(fz.conv_state), ss = device::to_host(fz.ssm_state);
    for (int64_t s = 0; s < num_slots; ++s) {
      if (std::find(slots.begin(), slots.end(), static_cast<int32_t>(s)) != slots.end()) continue;
      ASSERT_TRUE(test::bit_equal(cs.select(s), cs0.select(s))) << "conv slot " << s;
      ASSERT_TRUE(test::bit_equal(ss.select(s), ss0.select(s))) << "ssm slot " << s;
    }
  }
};

// Nemotron 3 Nano (64 heads, 8 groups) and Super (128 heads, 8 groups: 16 heads per group) at P 64, N 128, K 4.
TEST_P(OpsMambaDecodeUpdate, ModelShapesMatchThreeOps) {
  auto rng = test::Rng::for_test();
  const Dims nano{64, 64, 8, 128, 4}, super{128, 64, 8, 128, 4};
  for (int64_t batch : {1, 3}) check(rng, nano, batch, DType::kF32, DType::kF32);
  check(rng, super, 3, DType::kF32, DType::kF32);
  if (on_cuda()) {  // larger batches on the GPU only (the CPU reference is the slow part)
    check(rng, nano, 17, DType::kF32, DType::kF32);
    check(rng, nano, 64, DType::kF32, DType::kF32);
    check(rng, super, 17, DType::kF32, DType::kF32);
  }
}

// Groups 1, 2, 8 with 1..16 heads per group (the cluster is the group's heads, or a divisor of them), small P.
TEST_P(OpsMambaDecodeUpdate, GroupsAndHeadsPerGroup) {
  auto rng = test::Rng::for_test();
  const Dims dims[] = {{1, 16, 1, 64, 4},  {5, 16, 1, 64, 4},  {6, 24, 2, 64, 4},   {32, 16, 2, 64, 4},
                       {16, 16, 8, 64, 4}, {56, 8, 8, 64, 4},  {24, 16, 2, 128, 3}, {12, 16, 1, 256, 2},
                       {9, 16, 1, 64, 4},  {22, 8, 2, 128, 4}};
  for (const Dims& d : dims) {
    for (int64_t batch : {1, 3}) check(rng, d, batch, DType::kF32, DType::kF32);
  }
}

// Head dims that are not a multiple of the 64-row chunk (13) or span two chunks (80); N 16 and 32 (the test
// fixtures' sizes; the SSU's portable kernel); N 8 is not fused (the op composes the three ops on CUDA too).
TEST_P(OpsMambaDecodeUpdate, OddHeadDimsAndSmallStates) {
  auto rng = test::Rng::for_test();
  check(rng, {8, 13, 2, 128, 4}, 3, DType::kF32, DType::kF32);
  check(rng, {4, 80, 1, 64, 4}, 3, DType::kF32, DType::kF32);
  check(rng, {8, 16, 2, 16, 4}, 3, DType::kF32, DType::kF32);
  check(rng, {16, 8, 4, 16, 4}, 17, DType::kF32, DType::kF32);
  check(rng, {8, 32, 2, 32, 4}, 3, DType::kF32, DType::kF32);
  check(rng, {6, 8, 2, 8, 4}, 3, DType::kF32, DType::kF32);
}

// Three decode steps in a row on the same slots.
TEST_P(OpsMambaDecodeUpdate, RepeatedSteps) {
  auto rng = test::Rng::for_test();
  check(rng, {16, 64, 2, 128, 4}, 6, DType::kF32, DType::kF32, 3);
}

// Out of place (speculative verify): three steps in a chain, each reading the slot the previous one wrote, give the
// in-place three ops' out and states bit for bit, leave every source slot as it was, and skip pad rows.
TEST_P(OpsMambaDecodeUpdate, OutOfPlaceChainEqualsInPlace) {
  auto rng = test::Rng::for_test();
  for (DType act : {DType::kF32, DType::kBF16}) {
    if (act != DType::kF32 && !on_cuda()) continue;
    const Dims d{16, 64, 2, 128, 4};
    const int64_t batch = 3, steps = 3, num_slots = batch * (steps + 1);
    SCOPED_TRACE(dtype_name(act));
    const Inputs in = make_inputs(rng, d, batch, num_slots);
    OnDevice oop = place(in, GetParam(), act, DType::kF32, act), ref = place(in, GetParam(), act, DType::kF32, act);
    // Sequence b starts in slot b (b = 1 is a pad row); step j writes slot batch * (j + 1) + b.
    const std::vector<int32_t> live = {0, -1, 2};
    std::vector<int32_t> src = live;
    for (int64_t j = 0; j < steps; ++j) {
      SCOPED_TRACE(::testing::Message() << "step " << j);
      const Tensor zx = device::to_device(rng.normal_tensor({batch, d.width()}), GetParam(), act);
      oop.zxbcdt = zx, ref.zxbcdt = zx;
      std::vector<int32_t> dst(static_cast<size_t>(batch));
      for (int64_t b = 0; b < batch; ++b) dst[b] = static_cast<int32_t>(batch * (j + 1) + b);
      const Tensor before_cs = device::to_host(oop.conv_state), before_ss = device::to_host(oop.ssm_state);
      const Tensor out = output(act, {batch, d.Di()}), out_ref = output(act, {batch, d.Di()});
      ops::mamba_decode_update(ctx(), out, oop.zxbcdt, oop.conv_w, oop.conv_b, oop.p, oop.norm_w, d.G, 1e-5f,
                               oop.conv_state, oop.ssm_state, src, false, dst);
      three_ops(ctx(), out_ref, ref, d, live);  // in place on slots 0 and 2
      Tensor got = host_f32(out), want = host_f32(out_ref);
      zero_pad_rows(live, {&got, &want});
      EXPECT_TRUE(test::bit_equal(got, want)) << "out";
      const Tensor cs = device::to_host(oop.conv_state), ss = device::to_host(oop.ssm_state);
      const Tensor rcs = device::to_host(ref.conv_state), rss = device::to_host(ref.ssm_state);
      for (int64_t b = 0; b < batch; ++b) {
        if (live[b] < 0) {  // a pad row writes nothing, its destination included
          EXPECT_TRUE(test::bit_equal(cs.select(dst[b]), before_cs.select(dst[b]))) << "pad destination";
          continue;
        }
        EXPECT_TRUE(test::bit_equal(cs.select(dst[b]), rcs.select(live[b]))) << "conv state of " << b;
        EXPECT_TRUE(test::bit_equal(ss.select(dst[b]), rss.select(live[b]))) << "ssm state of " << b;
        EXPECT_TRUE(test::bit_equal(cs.select(src[b]), before_cs.select(src[b]))) << "source conv slot kept";
        EXPECT_TRUE(test::bit_equal(ss.select(src[b]), before_ss.select(src[b]))) << "source ssm slot kept";
      }
      for (int64_t b = 0; b < batch; ++b) src[b] = live[b] < 0 ? -1 : dst[b];
    }
  }
  // A destination that is another row's source is refused.
  const Dims d{4, 8, 2, 16, 4};
  const Inputs in = make_inputs(rng, d, 2, 4);
  const OnDevice o = place(in, GetParam(), DType::kF32, DType::kF32, DType::kF32);
  const Tensor out = output(DType::kF32, {2, d.Di()});
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::mamba_decode_update(ctx(), out, o.zxbcdt, o.conv_w, o.conv_b, o.p, o.norm_w, d.G, 1e-5f, o.conv_state,
                                 o.ssm_state, std::vector<int32_t>{0, 1}, false, std::vector<int32_t>{1, 3});
      },
      ErrorKind::kRuntime, "dst slot 1 of sequence 0 is the source slot of sequence 1"));
}

// ---- CUDA only: 16-bit activations and states ----------------------------------------------------------

TEST_P(OpsMambaDecodeUpdate, Bf16ActivationsAndStates) {
  if (!on_cuda()) GTEST_SKIP() << "16-bit activations are CUDA-only (the CPU reference is F32)";
  auto rng = test::Rng::for_test();
  const Dims nano{64, 64, 8, 128, 4}, super{128, 64, 8, 128, 4};
  for (DType sd : {DType::kF32, DType::kBF16}) {
    for (int64_t batch : {1, 3, 17, 64}) check(rng, nano, batch, DType::kBF16, sd);
    check(rng, super, 17, DType::kBF16, sd);
    check(rng, {12, 13, 2, 64, 3}, 5, DType::kBF16, sd);
    check(rng, {6, 16, 1, 256, 4}, 3, DType::kBF16, sd, 2);
    check(rng, {16, 8, 4, 16, 4}, 5, DType::kBF16, sd);  // N 16: 16 rows per lane pass in a 16-bit state
  }
  check(rng, nano, 9, DType::kF16, DType::kF16);
  check(rng, nano, 4, DType::kF32, DType::kBF16);  // state narrower than the activations
}

TEST_P(OpsMambaDecodeUpdate, RejectsMismatchedShapes) {
  auto rng = test::Rng::for_test();
  const Dims d{4, 8, 2, 16, 4};
  const Inputs in = make_inputs(rng, d, 2, 3);
  const OnDevice o = place(in, GetParam(), DType::kF32, DType::kF32, DType::kF32);
  const Tensor out = output(DType::kF32, {2, d.Di()});
  const Tensor narrow = device::empty(GetParam(), DType::kF32, {2, d.width() - 1});
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::mamba_decode_update(ctx(), out, narrow, o.conv_w, o.conv_b, o.p, o.norm_w, d.G, 1e-5f, o.conv_state,
                                 o.ssm_state, std::vector<int32_t>{0, 1});
      },
      ErrorKind::kRuntime, "ops::mamba_decode_update: zxbcdt"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::mamba_decode_update(ctx(), out, o.zxbcdt, o.conv_w, o.conv_b, o.p, o.norm_w, 3, 1e-5f, o.conv_state,
                                 o.ssm_state, std::vector<int32_t>{0, 1});
      },
      ErrorKind::kRuntime, "n_groups 3 does not divide"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::mamba_decode_update(ctx(), out, o.zxbcdt, o.conv_w, o.conv_b, o.p, o.norm_w, d.G, 1e-5f, o.conv_state,
                                 o.ssm_state, std::vector<int32_t>{1, 1});
      },
      ErrorKind::kRuntime, "slot 1 is used by more than one sequence"));
}

#ifdef CHIMERA_HAVE_CUDA
// Every cluster size (CTAs per group: 2, 4, 8, and 16 when the device schedules it; 1 would give one CTA the
// group's 16 heads, more channels than a CTA takes) computes the same states
// bit for bit; out differs only by the order of the cross-CTA sum of squares.
TEST_P(OpsMambaDecodeUpdate, EveryClusterSizeGivesTheSameStates) {
  if (!on_cuda()) GTEST_SKIP() << "launcher-level CUDA test";
  auto rng = test::Rng::for_test();
  const Dims d{128, 64, 8, 128, 4};
  const int64_t batch = 5;
  const Inputs in = make_inputs(rng, d, batch, batch + 2);
  const std::vector<int32_t> slot_ids = {6, 0, -1, 3, 5};
  const Tensor slots = on_backend(Tensor::from_i32({batch}, slot_ids));
  Tensor ref_out, ref_cs, ref_ss;
  for (int cluster : {0, 2, 4, 8, 16}) {
    SCOPED_TRACE(::testing::Message() << "cluster=" << cluster);
    const OnDevice o = place(in, Device::kCuda, DType::kBF16, DType::kF32, DType::kBF16);
    const Tensor out = output(DType::kBF16, {batch, d.Di()});
    cuda::MambaDecodeParams p;
    p.zxbcdt = o.zxbcdt.data(), p.out = out.data(), p.conv_weight = o.conv_w.data(), p.conv_bias = o.conv_b.data();
    p.conv_state = o.conv_state.data(), p.ssm_state = o.ssm_state.data(), p.slots = slots.i32();
    p.A_log = o.p.A_log.data(), p.D = o.p.D.data(), p.dt_bias = o.p.dt_bias.data(), p.norm_weight = o.norm_w.data();
    p.act = DType::kBF16, p.conv_weight_dtype = p.conv_bias_dtype = p.norm_weight_dtype = DType::kBF16;
    p.conv_state_dtype = DType::kBF16, p.ssm_state_dtype = DType::kF32;
    p.dt_min = 0.0f, p.dt_max = INFINITY, p.eps = 1e-5f;
    p.batch = int(batch), p.H = int(d.H), p.P = int(d.P), p.N = int(d.N), p.G = int(d.G), p.K = int(d.K);
    p.cluster = cluster;
    if (cuda::mamba_decode_fused_cluster(p) == 0) {
      ASSERT_EQ(cluster, 16) << "only the non-portable cluster may be refused";
      continue;
    }
    cuda::launch_mamba_decode_fused(p, nullptr);
    device::synchronize(Device::kCuda);
    Tensor got = host_f32(out);
    const Tensor cs = device::to_host(o.conv_state), ss = device::to_host(o.ssm_state);
    for (int64_t i = 2 * d.Di(); i < 3 * d.Di(); ++i) ASSERT_TRUE(std::isnan(got.f32()[i])) << "pad row written";
    zero_pad_rows(slot_ids, {&got});
    if (cluster == 0) {
      ref_out = got, ref_cs = cs, ref_ss = ss;
    } else {
      EXPECT_TRUE(test::bit_equal(cs, ref_cs));
      EXPECT_TRUE(test::bit_equal(ss, ref_ss));
      EXPECT_TRUE(test::all_close(got, ref_out, test::kBF16Elementwise));
    }
  }
}
#endif

CHIMERA_INSTANTIATE_BACKENDS(OpsMambaDecodeUpdate);

}  // namespace
}  // namespace chimera
