// causal_conv1d / causal_conv1d_update: packed batches with per-slot state, against a naive loop, on every
// backend; CUDA-only cases for bf16 activations, bf16 / f16 conv state and the vector / portable kernel paths.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/mamba/conv1d.cuh"
#endif

namespace chimera {
namespace {

using test::BackendTest;

// Naive oracle: per sequence, history = conv_state[slot] (K-1 columns) ++ new inputs; double accumulation.
// Updates `state` (a host F32 copy) and writes `out` rows (host F32); pad sequences are skipped.
void naive_conv(Tensor& out, const Tensor& x, const Tensor& w_any, const Tensor& bias, Tensor& state,
                const std::vector<int32_t>& cu, const std::vector<int32_t>& slots, bool silu) {
  const int64_t C = x.dim(1);
  const Tensor w = w_any.to_f32();
  const Tensor b = bias ? bias.to_f32() : Tensor();
  const int64_t K = w.numel() / C;
  std::vector<double> hist;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] < 0) continue;
    const int64_t n = cu[s + 1] - cu[s];
    for (int64_t c = 0; c < C; ++c) {
      hist.clear();
      float* st = state.f32() + (slots[s] * C + c) * (K - 1);
      for (int64_t j = 0; j < K - 1; ++j) hist.push_back(st[j]);
      for (int64_t t = 0; t < n; ++t) hist.push_back(x.f32()[(cu[s] + t) * C + c]);
      for (int64_t t = 0; t < n; ++t) {
        double acc = b ? b.f32()[c] : 0.0;
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

// A host F32 copy rounded through `dtype` (what a tensor of that dtype holds).
Tensor rounded(const Tensor& f32, DType dtype) { return test::cast_to(f32, dtype).to_f32(); }

// A random batch: n_seqs sequences of lengths in [0, max_len], every fifth a pad, slots a permutation of a
// larger slot range (so some slots are unused).
struct RandomBatch {
  std::vector<int32_t> lens, slots, cu;
  int64_t num_slots = 0;
};
RandomBatch random_batch(test::Rng& rng, int n_seqs, int max_len) {
  RandomBatch rb;
  rb.num_slots = n_seqs + 3;
  rb.slots = test::batch_slots(rng, n_seqs, rb.num_slots);  // draws before the lengths, as it always did
  for (int s = 0; s < n_seqs; ++s) rb.lens.push_back(static_cast<int32_t>(rng.integer(0, max_len)));
  rb.cu = cu_from(rb.lens);
  return rb;
}

class OpsConv1d : public BackendTest {
 protected:
  // Through the CUDA launchers instead of through ops:: (launcher_).
  bool launcher_ = false;
  bool variant() const { return launcher_; }

  // The ops:: adapters' job, through the launchers with the variant fields set (CUDA only).
  void launch_variant(const Tensor& out, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& state,
                      const std::vector<int32_t>& cu, const std::vector<int32_t>& slots, bool silu, bool update) {
#ifdef CHIMERA_HAVE_CUDA
    cuda::Conv1dParams p;
    p.x = x.data(), p.out = out.data(), p.weight = w.data(), p.bias = bias ? bias.data() : nullptr;
    p.conv_state = state.data();
    p.act = x.dtype(), p.weight_dtype = w.dtype(), p.bias_dtype = bias ? bias.dtype() : DType::kF32;
    p.state_dtype = state.dtype();
    p.C = x.dim(1), p.K = int(w.dim(-1)), p.silu = silu;
    Tensor meta;
    if (update) {
      meta = on_backend(Tensor::from_i32({int64_t(slots.size())}, slots));
      p.slots = meta.i32(), p.batch = int(slots.size());
      cuda::launch_causal_conv1d_update(p, nullptr);
    } else {
      const std::vector<cuda::Conv1dTile> tiles = cuda::conv1d_tiles(cu, slots);
      if (tiles.empty()) return;
      std::vector<int32_t> flat;
      for (const cuda::Conv1dTile& t : tiles) flat.insert(flat.end(), {t.row_begin, t.len, t.t0, t.slot});
      meta = on_backend(Tensor::from_i32({int64_t(flat.size())}, flat));
      p.tiles = reinterpret_cast<const cuda::Conv1dTile*>(meta.i32()), p.n_tiles = int(tiles.size());
      cuda::launch_causal_conv1d(p, nullptr);
    }
    device::synchronize(Device::kCuda);
#else
    (void)out, (void)x, (void)w, (void)bias, (void)state, (void)cu, (void)slots, (void)silu, (void)update;
    FAIL() << "launcher variants are CUDA-only";
#endif
  }

  // Runs causal_conv1d on the backend under test with x in `act`, the state in `state_dtype`, and checks
  // out and the final state against the naive oracle fed the same rounded values. Unused and pad slots
  // must keep their bits.
  void check_prefill(test::Rng& rng, const std::vector<int32_t>& cu, const std::vector<int32_t>& slots,
                     int64_t num_slots, int64_t C, int64_t K, DType act, DType state_dtype, DType wt, bool silu) {
    const int64_t T = cu.back();
    const Tensor x = on_backend(rng.normal_tensor({T, C}), act);
    const Tensor w = on_backend(test::cast_to(rng.normal_tensor({C, 1, K}, 0.5f), wt));
    const Tensor bias = on_backend(test::cast_to(rng.normal_tensor({C}), wt));
    const Tensor state = on_backend(rng.normal_tensor({num_slots, C, K - 1}), state_dtype);
    const Tensor state0 = host_f32(state);
    const Tensor out = output(act, {T, C});
    if (variant()) {
      launch_variant(out, x, w, bias, state, cu, slots, silu, false);
    } else {
      ops::causal_conv1d(ctx(), out, x, w, bias, state, cu, slots, silu);
    }

    Tensor want = Tensor::empty(DType::kF32, {T, C}), want_state = state0.clone();
    test::poison(want);
    naive_conv(want, host_f32(x), host_f32(w), host_f32(bias), want_state, cu, slots, silu);
    const test::Tolerance tol = act == DType::kF32 ? test::kF32Elementwise : test::kBF16Elementwise;
    EXPECT_ALL_CLOSE(host_f32(out), want, tol);  // pad rows stay poisoned on both sides
    // The state holds copies of inputs: exact after rounding to its dtype.
    EXPECT_TRUE(test::bit_equal(host_f32(state), rounded(want_state, state_dtype)));
    const Tensor got_state = host_f32(state);
    for (int64_t s = 0; s < num_slots; ++s) {
      const auto it = std::find(slots.begin(), slots.end(), static_cast<int32_t>(s));
      if (it == slots.end() || cu[size_t(it - slots.begin()) + 1] == cu[size_t(it - slots.begin())]) {
        EXPECT_TRUE(test::bit_equal(got_state.select(s), state0.select(s))) << "untouched slot " << s;
      }
    }
  }

  void check_update(test::Rng& rng, const std::vector<int32_t>& slots, int64_t num_slots, int64_t C, int64_t K,
                    DType act, DType state_dtype, DType wt) {
    const int64_t Bn = static_cast<int64_t>(slots.size());
    const Tensor x = on_backend(rng.normal_tensor({Bn, C}), act);
    const Tensor w = on_backend(test::cast_to(rng.normal_tensor({C, K}, 0.5f), wt));
    const Tensor bias = on_backend(test::cast_to(rng.normal_tensor({C}), wt));
    const Tensor state = on_backend(rng.normal_tensor({num_slots, C, K - 1}), state_dtype);
    const Tensor state0 = host_f32(state);
    const Tensor out = output(act, {Bn, C});
    if (variant()) {
      launch_variant(out, x, w, bias, state, {}, slots, true, true);
    } else {
      ops::causal_conv1d_update(ctx(), out, x, w, bias, state, slots, true);
    }

    Tensor want = Tensor::empty(DType::kF32, {Bn, C}), want_state = state0.clone();
    test::poison(want);
    naive_conv(want, host_f32(x), host_f32(w), host_f32(bias), want_state, cu_from(std::vector<int32_t>(Bn, 1)),
               slots, true);
    const test::Tolerance tol = act == DType::kF32 ? test::kF32Elementwise : test::kBF16Elementwise;
    EXPECT_ALL_CLOSE(host_f32(out), want, tol);
    EXPECT_TRUE(test::bit_equal(host_f32(state), rounded(want_state, state_dtype)));
  }
};

TEST_P(OpsConv1d, PackedBatchWithSlotsMatchesNaive) {
  auto rng = test::Rng::for_test();
  // Mixed lengths incl. 1, one shorter than K-1, an empty one and a pad; permuted, non-contiguous slots.
  const std::vector<int32_t> lens = {17, 1, 2, 5, 0, 13};
  const std::vector<int32_t> slots = {5, 0, 3, -1, 6, 2};
  const auto cu = cu_from(lens);
  for (int64_t K : {4, 3, 2}) {
    for (int64_t C : {33, 500}) {
      for (bool silu : {true, false}) {
        for (DType wt : {DType::kF32, DType::kBF16}) {
          SCOPED_TRACE(::testing::Message() << "K=" << K << " C=" << C << " silu=" << silu << " w=" << dtype_name(wt));
          check_prefill(rng, cu, slots, 8, C, K, DType::kF32, DType::kF32, wt, silu);
        }
      }
    }
  }
}

TEST_P(OpsConv1d, NoBiasMatchesNaive) {
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> cu = {0, 3, 20}, slots = {1, 0};
  for (int64_t C : {33, 264}) {  // element-wise and vector paths
    SCOPED_TRACE(::testing::Message() << "C=" << C);
    const Tensor xh = rng.normal_tensor({20, C}), wh = rng.normal_tensor({C, 4}), sh = rng.normal_tensor({2, C, 3});
    const Tensor x = on_backend(xh), w = on_backend(wh), state = on_backend(sh);
    Tensor want_state = sh.clone();
    const Tensor out = output(DType::kF32, {20, C});
    Tensor want = Tensor::empty(DType::kF32, {20, C});
    ops::causal_conv1d(ctx(), out, x, w, Tensor(), state, cu, slots, true);
    naive_conv(want, xh, wh, Tensor(), want_state, cu, slots, true);
    EXPECT_ALL_CLOSE(host_f32(out), want, test::kF32Elementwise);
    EXPECT_ALL_CLOSE(host_f32(state), want_state, test::kF32Elementwise);
    // The update without bias.
    const Tensor out_u = output(DType::kF32, {2, C});
    ops::causal_conv1d_update(ctx(), out_u, x.rows(0, 2), w, Tensor(), state, slots, false);
    Tensor want_u = Tensor::empty(DType::kF32, {2, C});
    naive_conv(want_u, xh.rows(0, 2), wh, Tensor(), want_state, {0, 1, 2}, slots, false);
    EXPECT_ALL_CLOSE(host_f32(out_u), want_u, test::kF32Elementwise);
    EXPECT_ALL_CLOSE(host_f32(state), want_state, test::kF32Elementwise);
  }
}

// The awkward token counts of the issue, one sequence each and all packed together, K = 4, vector path
// (C = 264 is a multiple of the 16-byte vector for f32 and bf16).
TEST_P(OpsConv1d, AwkwardTokenCountsMatchNaive) {
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> counts = {1, 3, 17, 111, 989, 4099};
  for (int32_t n : counts) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << n);
    check_prefill(rng, {0, n}, {1}, 3, 264, 4, DType::kF32, DType::kF32, DType::kF32, true);
  }
  SCOPED_TRACE("all packed");
  check_prefill(rng, cu_from(counts), {4, 0, 7, 2, 5, 1}, 8, 264, 4, DType::kF32, DType::kF32, DType::kBF16, true);
}

TEST_P(OpsConv1d, SplitInTwoCallsEqualsOneCall) {
  auto rng = test::Rng::for_test();
  const int64_t K = 4;
  // C = 33: element-wise path; C = 264: 16-byte vector path. f32 activations and state everywhere; on CUDA
  // also bf16 activations with an f32 state (the state holds the bf16 inputs exactly).
  for (DType act : {DType::kF32, DType::kBF16}) {
    if (act != DType::kF32 && !on_cuda()) continue;
    for (int64_t C : {33, 264}) {
      for (int32_t split : {1, 2, 9, 22, 33, 64}) {
        SCOPED_TRACE(::testing::Message() << "act=" << dtype_name(act) << " C=" << C << " split=" << split);
        const int32_t n = 71;
        const Tensor x = on_backend(rng.normal_tensor({n, C}), act);
        const Tensor w = on_backend(rng.normal_tensor({C, K})), bias = on_backend(rng.normal_tensor({C}));
        const Tensor state0 = rng.normal_tensor({3, C, K - 1});
        const std::vector<int32_t> slot = {2};
        const Tensor whole = output(act, {n, C}), parts = output(act, {n, C});
        const Tensor s_whole = on_backend(state0), s_parts = on_backend(state0);
        ops::causal_conv1d(ctx(), whole, x, w, bias, s_whole, std::vector<int32_t>{0, n}, slot, true);
        ops::causal_conv1d(ctx(), parts.rows(0, split), x.rows(0, split), w, bias, s_parts,
                           std::vector<int32_t>{0, split}, slot, true);
        ops::causal_conv1d(ctx(), parts.rows(split, n), x.rows(split, n), w, bias, s_parts,
                           std::vector<int32_t>{0, n - split}, slot, true);
        EXPECT_TRUE(test::bit_equal(device::to_host(parts), device::to_host(whole)));
        EXPECT_TRUE(test::bit_equal(host_f32(s_parts), host_f32(s_whole)));
      }
    }
  }
}

// Checkpoints (prefix caching) hold, bit for bit, the state a call over the sequence's first `rows` rows leaves:
// cuts under K-1 rows in (the window reaches into the old state), at tile edges and past them, several per sequence
// and none in some; outputs and final states are those of the call without checkpoints.
TEST_P(OpsConv1d, CheckpointsHoldTheStateAtTheCut) {
  auto rng = test::Rng::for_test();
  const int64_t K = 4;
  const std::vector<int32_t> lens = {71, 5, 0, 40}, slots = {2, 0, -1, 4};
  const std::vector<ops::StateCheckpoint> cps = {{0, 1, 5}, {0, 2, 6}, {0, 33, 7}, {0, 64, 8}, {3, 39, 9}};
  const auto cu = cu_from(lens);
  for (DType act : {DType::kF32, DType::kBF16}) {
    if (act != DType::kF32 && !on_cuda()) continue;
    for (int64_t C : {33, 264}) {
      SCOPED_TRACE(::testing::Message() << "act=" << dtype_name(act) << " C=" << C);
      const Tensor x = on_backend(rng.normal_tensor({cu.back(), C}), act);
      const Tensor w = on_backend(rng.normal_tensor({C, K})), bias = on_backend(rng.normal_tensor({C}));
      const Tensor state0 = rng.normal_tensor({10, C, K - 1});
      const Tensor with = output(act, {cu.back(), C}), without = output(act, {cu.back(), C});
      const Tensor s_with = on_backend(state0), s_without = on_backend(state0);
      ops::causal_conv1d(ctx(), with, x, w, bias, s_with, cu, slots, true, cps);
      ops::causal_conv1d(ctx(), without, x, w, bias, s_without, cu, slots, true);
      EXPECT_TRUE(test::bit_equal(device::to_host(with), device::to_host(without)));
      const Tensor got = host_f32(s_with), plain = host_f32(s_without);
      for (int32_t s : {0, 1, 2, 3, 4}) EXPECT_TRUE(test::bit_equal(got.select(s), plain.select(s))) << "slot " << s;
      for (const ops::StateCheckpoint& k : cps) {
        const Tensor s_prefix = on_backend(state0), out = output(act, {k.rows, C});
        const int32_t begin = cu[static_cast<size_t>(k.seq)];
        const std::vector<int32_t> slot = {slots[static_cast<size_t>(k.seq)]};
        ops::causal_conv1d(ctx(), out, x.rows(begin, begin + k.rows), w, bias, s_prefix,
                           std::vector<int32_t>{0, k.rows}, slot, true);
        EXPECT_TRUE(test::bit_equal(got.select(k.slot), host_f32(s_prefix).select(slot[0])))
            << "checkpoint after " << k.rows << " rows of sequence " << k.seq;
      }
    }
  }
}

TEST_P(OpsConv1d, CheckpointRulesAreChecked) {
  const int64_t C = 8, K = 4;
  const Tensor x = on_backend(Tensor::zeros(DType::kF32, {10, C})), w = on_backend(Tensor::zeros(DType::kF32, {C, K}));
  const Tensor state = on_backend(Tensor::zeros(DType::kF32, {6, C, K - 1})), out = output(DType::kF32, {10, C});
  const std::vector<int32_t> cu = {0, 6, 10}, slots = {0, -1};
  using Cps = std::vector<ops::StateCheckpoint>;
  for (const auto& [cps, what] :
       std::vector<std::pair<Cps, const char*>>{{{{0, 0, 3}}, "after 0 of sequence 0's 6 rows"},
                                                {{{0, 6, 3}}, "after 6 of sequence 0's 6 rows"},
                                                {{{1, 2, 3}}, "not a live sequence"},
                                                {{{0, 2, 0}}, "already a sequence's"},
                                                {{{0, 2, 3}, {0, 3, 3}}, "already a sequence's or a checkpoint's"},
                                                {{{0, 3, 3}, {0, 2, 4}}, "out of order"},
                                                {{{0, 3, 6}}, "out of range"}}) {
    EXPECT_TRUE(test::throws_error([&] { ops::causal_conv1d(ctx(), out, x, w, Tensor(), state, cu, slots, true, cps); },
                                   ErrorKind::kRuntime, what))
        << what;
  }
}

TEST_P(OpsConv1d, UpdateEqualsOneTokenConv) {
  auto rng = test::Rng::for_test();
  for (int64_t K : {2, 3, 4}) {
    for (int64_t C : {500, 33}) {
      SCOPED_TRACE(::testing::Message() << "K=" << K << " C=" << C);
      const int64_t Bn = 5;
      const std::vector<int32_t> slots = {4, -1, 0, 6, 2};
      const Tensor x = on_backend(rng.normal_tensor({Bn, C})), w = on_backend(rng.normal_tensor({C, 1, K}));
      const Tensor bias = on_backend(rng.normal_tensor({C}));
      const Tensor state0 = rng.normal_tensor({7, C, K - 1});
      const Tensor out_u = output(DType::kF32, {Bn, C}), out_c = output(DType::kF32, {Bn, C});
      const Tensor s_u = on_backend(state0), s_c = on_backend(state0);
      ops::causal_conv1d_update(ctx(), out_u, x, w, bias, s_u, slots, true);
      ops::causal_conv1d(ctx(), out_c, x, w, bias, s_c, cu_from(std::vector<int32_t>(Bn, 1)), slots, true);
      const Tensor hu = host_f32(out_u);
      EXPECT_TRUE(test::bit_equal(hu, host_f32(out_c)));
      EXPECT_TRUE(test::bit_equal(host_f32(s_u), host_f32(s_c)));
      EXPECT_TRUE(std::isnan(hu.f32()[1 * C]));  // the pad row is left untouched
    }
  }
}

TEST_P(OpsConv1d, UpdateBatchesMatchNaive) {
  auto rng = test::Rng::for_test();
  for (int n : {1, 3, 64}) {
    const RandomBatch rb = random_batch(rng, n, 1);
    for (int64_t C : {264, 2688}) {
      SCOPED_TRACE(::testing::Message() << "batch=" << n << " C=" << C);
      check_update(rng, rb.slots, rb.num_slots, C, 4, DType::kF32, DType::kF32, DType::kBF16);
    }
  }
}

// Views whose data pointer is not 16-byte aligned take the element-wise kernels on CUDA.
TEST_P(OpsConv1d, UnalignedViewsMatchNaive) {
  auto rng = test::Rng::for_test();
  const int64_t C = 264, K = 4, T = 45;
  const std::vector<int32_t> cu = {0, 40, 45}, slots = {2, 0};
  auto shifted = [&](const Tensor& host) {  // the same values one element into a bigger buffer
    Tensor big = Tensor::empty(DType::kF32, {host.numel() + 1});
    std::copy_n(host.f32(), host.numel(), big.f32() + 1);
    return on_backend(big).rows(1, host.numel() + 1).reshape(host.shape());
  };
  const Tensor xh = rng.normal_tensor({T, C}), wh = rng.normal_tensor({C, K}), bh = rng.normal_tensor({C});
  const Tensor sh = rng.normal_tensor({3, C, K - 1});
  const Tensor x = shifted(xh), state = shifted(sh), w = on_backend(wh), bias = on_backend(bh);
  const Tensor out = output(DType::kF32, {T, C});
  ops::causal_conv1d(ctx(), out, x, w, bias, state, cu, slots, true);
  Tensor want = Tensor::empty(DType::kF32, {T, C}), want_state = sh.clone();
  naive_conv(want, xh, wh, bh, want_state, cu, slots, true);
  EXPECT_ALL_CLOSE(host_f32(out), want, test::kF32Elementwise);
  EXPECT_ALL_CLOSE(host_f32(state), want_state, test::kF32Elementwise);

  // The update with a misaligned state.
  const Tensor xu = shifted(xh.rows(0, 2)), out_u = output(DType::kF32, {2, C});
  ops::causal_conv1d_update(ctx(), out_u, xu, w, bias, state, slots, true);
  Tensor want_u = Tensor::empty(DType::kF32, {2, C});
  naive_conv(want_u, xh.rows(0, 2), wh, bh, want_state, {0, 1, 2}, slots, true);
  EXPECT_ALL_CLOSE(host_f32(out_u), want_u, test::kF32Elementwise);
  EXPECT_ALL_CLOSE(host_f32(state), want_state, test::kF32Elementwise);
}

// ---- CUDA only: bf16 / f16 activations, bf16 / f16 conv state, model shapes --------------------------

TEST_P(OpsConv1d, Bf16ActivationsEveryStateDtype) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are CUDA-only (the CPU reference is F32)";
  auto rng = test::Rng::for_test();
  for (int n_seqs : {1, 7, 64}) {
    // Lengths up to 70 (40 for 64 sequences): sequences shorter than K-1, inside one 32-token tile and
    // crossing tiles. Hidden-size-like widths 4480 and 2688 (multiples of 8 but not of 256).
    const RandomBatch rb = random_batch(rng, n_seqs, n_seqs == 64 ? 40 : 70);
    const int64_t C = n_seqs == 64 ? 2688 : 4480;
    for (DType state_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(::testing::Message() << "seqs=" << n_seqs << " C=" << C << " state=" << dtype_name(state_dtype));
      check_prefill(rng, rb.cu, rb.slots, rb.num_slots, C, 4, DType::kBF16, state_dtype, DType::kBF16, true);
    }
  }
  SCOPED_TRACE("f16 activations, K=3, C=500 (element-wise path)");
  const RandomBatch rb = random_batch(rng, 9, 50);
  check_prefill(rng, rb.cu, rb.slots, rb.num_slots, 500, 3, DType::kF16, DType::kBF16, DType::kF32, false);
}

TEST_P(OpsConv1d, Bf16LongPromptsAtModelWidths) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are CUDA-only";
  auto rng = test::Rng::for_test();
  // Nano conv_dim 6144 and Super 10240; prompts crossing many tiles with a non-zero initial state.
  check_prefill(rng, {0, 989, 1100}, {3, 0}, 4, 6144, 4, DType::kBF16, DType::kF32, DType::kBF16, true);
  check_prefill(rng, {0, 111, 128, 457}, {1, -1, 2}, 3, 10240, 4, DType::kBF16, DType::kBF16, DType::kBF16, true);
}

TEST_P(OpsConv1d, UpdateBf16EveryStateDtype) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are CUDA-only";
  auto rng = test::Rng::for_test();
  for (int n : {1, 5, 64}) {
    const RandomBatch rb = random_batch(rng, n, 1);
    for (DType state_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (int64_t C : {6144, 10240}) {
        SCOPED_TRACE(::testing::Message() << "batch=" << n << " C=" << C << " state=" << dtype_name(state_dtype));
        check_update(rng, rb.slots, rb.num_slots, C, 4, DType::kBF16, state_dtype, DType::kBF16);
      }
    }
  }
  SCOPED_TRACE("f32 activations, f16 state, K=2; element-wise path (C = 66)");
  check_update(rng, {2, -1, 0}, 4, 66, 2, DType::kF32, DType::kF16, DType::kF32);
}

// The update kernel through the launcher against the oracle, with pads and permuted slots, bf16 activations and
// every state dtype, C not a multiple of the block's channels.
TEST_P(OpsConv1d, UpdateThroughTheLauncherMatchesNaive) {
  if (!on_cuda()) GTEST_SKIP() << "launcher-level CUDA test";
  auto rng = test::Rng::for_test();
  launcher_ = true;
  for (int n : {1, 7, 64}) {
    const RandomBatch rb = random_batch(rng, n, 1);
    for (DType sd : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(::testing::Message() << "batch=" << n << " state=" << dtype_name(sd));
      check_update(rng, rb.slots, rb.num_slots, 2688, 4, DType::kBF16, sd, DType::kBF16);
    }
  }
  SCOPED_TRACE("f32 activations and state, K = 3, C = 264");
  check_update(rng, {2, -1, 0, 5, 3}, 6, 264, 3, DType::kF32, DType::kF32, DType::kF32);
}

TEST_P(OpsConv1d, CudaRejectsWhatItDoesNotSupport) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA dispatch limits";
  const Tensor x = on_backend(Tensor::zeros(DType::kF32, {4, 8}));
  const Tensor out16 = output(DType::kBF16, {4, 8});
  const Tensor state = on_backend(Tensor::zeros(DType::kF32, {2, 8, 3}));
  const Tensor w = on_backend(Tensor::zeros(DType::kF32, {8, 4}));
  const std::vector<int32_t> cu = {0, 4}, slot = {0};
  EXPECT_TRUE(test::throws_error([&] { ops::causal_conv1d(ctx(), out16, x, w, Tensor(), state, cu, slot, true); },
                                 ErrorKind::kRuntime, "must share one dtype on CUDA"));
  EXPECT_TRUE(test::throws_error([&] { ops::causal_conv1d(ctx(), x, x, w, Tensor(), state, cu, slot, true); },
                                 ErrorKind::kRuntime, "ops::causal_conv1d: out must not overlap x on CUDA"));
  const Tensor w5 = on_backend(Tensor::zeros(DType::kF32, {8, 5}));
  const Tensor state4 = on_backend(Tensor::zeros(DType::kF32, {2, 8, 4}));
  const Tensor out = output(DType::kF32, {4, 8});
  EXPECT_TRUE(test::throws_error([&] { ops::causal_conv1d(ctx(), out, x, w5, Tensor(), state4, cu, slot, true); },
                                 ErrorKind::kRuntime, "conv_kernel 5 is not supported on CUDA (2, 3, 4)"));
}

TEST_P(OpsConv1d, BadShapesThrowNamingTheOp) {
  const Tensor x = on_backend(Tensor::zeros(DType::kF32, {4, 8}));
  const Tensor out = output(DType::kF32, {4, 8});
  const Tensor w = on_backend(Tensor::zeros(DType::kF32, {8, 4}));
  const Tensor state = on_backend(Tensor::zeros(DType::kF32, {2, 8, 3}));
  const Tensor state4 = on_backend(Tensor::zeros(DType::kF32, {2, 8, 4}));
  const std::vector<int32_t> cu = {0, 4}, slot = {0};
  EXPECT_TRUE(test::throws_error(
      [&] { ops::causal_conv1d(ctx(), out, x, w, Tensor(), state4, cu, slot, true); }, ErrorKind::kRuntime,
      "ops::causal_conv1d: conv_state F32[2, 8, 4] does not match weight F32[8, 4]"));
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
