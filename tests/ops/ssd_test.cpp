// Mamba-2 SSM: ssd_chunk_scan == ssm_recurrence == a naive double recurrence; prefill then decode.
// Every case runs on each backend (inputs moved there, outputs poisoned, results compared on the host); the
// Cuda* cases add what only the GPU has: bf16 / f16 activations and states, the tensor-core shape
// (P = 64, N = 128, chunk 128) at awkward token counts, packed batches of up to 64 sequences.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/mamba/ssd_kernels.cuh"
#endif

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

// Naive recurrence (docs/model.md 3.3) in double; the state is a host copy updated in place.
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

// A host F32 copy of t with its values rounded through `dtype` (what a tensor stored as dtype holds).
Tensor rounded(const Tensor& t, DType dtype) { return dtype == DType::kF32 ? t.clone() : test::cast_to(t, dtype).to_f32(); }

SsmInputs rounded(const SsmInputs& in, DType act, DType weights) {
  SsmInputs r;
  r.x = rounded(in.x, act);
  r.dt_raw = rounded(in.dt_raw, act);
  r.B = rounded(in.B, act);
  r.C = rounded(in.C, act);
  r.p = in.p;
  r.p.A_log = rounded(in.p.A_log, weights);
  r.p.D = rounded(in.p.D, weights);
  r.p.dt_bias = rounded(in.p.dt_bias, weights);
  return r;
}

// Slots that no non-empty sequence uses keep their bits.
void expect_unused_slots_kept(const Tensor& state, const Tensor& state0, const std::vector<int32_t>& lens,
                              const std::vector<int32_t>& slots) {
  for (int64_t s = 0; s < state0.dim(0); ++s) {
    const auto it = std::find(slots.begin(), slots.end(), s);
    if (it == slots.end() || lens[size_t(it - slots.begin())] == 0) {
      EXPECT_TRUE(test::bit_equal(state.select(s), state0.select(s))) << "slot " << s;
    }
  }
}

const SsmCase kCases[] = {{3, 5, 1, 7}, {4, 8, 2, 16}, {8, 4, 8, 3}, {6, 16, 2, 32}};
// The tensor-core shape (head_dim 64, ssm_state_size 128) with the head counts of Nemotron 3 Nano and Super.
constexpr SsmCase kNano{64, 64, 8, 128};
constexpr SsmCase kSuper{128, 64, 8, 128};

class OpsSsd : public BackendTest {
 public:
  // A host F32 tensor on the backend under test, stored as `dtype` (the CPU reference takes F32 only;
  // its copy is a plain clone so CPU-only machines need no CUDA runtime).
  Tensor dev(const Tensor& host, DType dtype = DType::kF32) const {
    return on_cuda() ? on_backend(host, dtype) : host.clone();
  }
  SsmInputs dev(const SsmInputs& in, DType act = DType::kF32, DType weights = DType::kF32) const {
    SsmInputs d;
    d.x = dev(in.x, act);
    d.dt_raw = dev(in.dt_raw, act);
    d.B = dev(in.B, act);
    d.C = dev(in.C, act);
    d.p = in.p;
    d.p.A_log = dev(in.p.A_log, weights);
    d.p.D = dev(in.p.D, weights);
    d.p.dt_bias = dev(in.p.dt_bias, weights);
    return d;
  }
  // A NaN-poisoned output on the backend under test.
  Tensor poisoned(DType dtype, const Shape& shape) const {
    if (on_cuda()) return output(dtype, shape);
    Tensor t = Tensor::empty(DType::kF32, shape);
    test::poison(t);
    return t;
  }

#ifdef CHIMERA_HAVE_CUDA
  // A tensor-core variant to run instead of ops::ssd_chunk_scan's defaults (CUDA only, through cuda::SsdRunner
  // with the same inputs, which ops:: would have validated).
  std::optional<cuda::SsdOptions> variant;
#endif
  void scan_on_backend(const Tensor& y, const SsmInputs& d, const Tensor& state, const std::vector<int32_t>& cu,
                       const std::vector<int32_t>& slots, int64_t chunk) const {
#ifdef CHIMERA_HAVE_CUDA
    if (on_cuda() && variant) {
      cuda::SsdRunner(y, d.x, d.dt_raw, d.B, d.C, d.p, state, cu, slots, chunk, nullptr, *variant).run();
      return;
    }
#endif
    ops::ssd_chunk_scan(ctx(), y, d.x, d.dt_raw, d.B, d.C, d.p, state, cu, slots, chunk);
  }

  // One ssd_chunk_scan on the backend (activations stored as `act`, parameters as `weights`, the state as
  // `state_dtype`) against the CPU reference run on the same rounded values: y, final states, pad rows,
  // untouched slots. F32 everywhere -> the fp32 reduction rows; any 16-bit storage -> the bf16 rows.
  void check_scan(test::Rng& rng, const SsmCase& c, const std::vector<int32_t>& lens,
                  const std::vector<int32_t>& slots, int64_t num_slots, int64_t chunk, DType act,
                  DType state_dtype = DType::kF32, DType weights = DType::kF32, float dt_min = 0.0f,
                  float dt_max = 1.0f / 0.0f) const {
    const auto cu = cu_from(lens);
    SsmInputs in = make_inputs(rng, cu.back(), c);
    in.p.dt_min = dt_min;
    in.p.dt_max = dt_max;
    const SsmInputs ref = rounded(in, act, weights);
    const Tensor state0 = rounded(rng.normal_tensor({num_slots, c.H, c.P, c.N}, 0.5f), state_dtype);

    Tensor want = Tensor::empty(DType::kF32, in.x.shape()), want_state = state0.clone();
    test::poison(want);
    ops::ssd_chunk_scan(ops::Context{}, want, ref.x, ref.dt_raw, ref.B, ref.C, ref.p, want_state, cu, slots, chunk);

    const SsmInputs d = dev(ref, act, weights);
    const Tensor y = poisoned(act, in.x.shape());
    const Tensor state = dev(state0, state_dtype);
    scan_on_backend(y, d, state, cu, slots, chunk);
    Tensor got = host_f32(y);
    const Tensor got_state = host_f32(state);

    const bool f32 = act == DType::kF32 && state_dtype == DType::kF32 && weights == DType::kF32;
    const double nmse = f32 ? test::kF32ReductionNmse : test::kBF16ReductionNmse;
    const test::Tolerance tol = f32 ? test::kF32Reduction : test::kBF16Reduction;
    expect_pad_rows_untouched(got, want, cu, slots);
    EXPECT_TRUE(test::nmse_close(got, want, nmse, tol)) << "y";
    EXPECT_TRUE(test::nmse_close(got_state, want_state, nmse, tol)) << "final states";
    expect_unused_slots_kept(got_state, state0, lens, slots);
  }

  // A packed batch with slots drawn from a shuffled pool of batch + 7, sequence 2 (and sequence
  // batch - 2 of a large batch) a pad, for each activation dtype in `acts`.
  void run_batch(test::Rng& rng, const SsmCase& c, const std::vector<int32_t>& lens,
                 std::initializer_list<DType> acts = {DType::kBF16, DType::kF32}) const {
    const int64_t batch = static_cast<int64_t>(lens.size()), num_slots = batch + 7;
    std::vector<int32_t> pool(static_cast<size_t>(num_slots));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng.engine());
    std::vector<int32_t> slots(pool.begin(), pool.begin() + batch);
    if (batch > 2) slots[2] = -1;
    if (batch > 8) slots[static_cast<size_t>(batch) - 2] = -1;
    for (DType act : acts) {
      SCOPED_TRACE(::testing::Message() << "batch=" << batch << " H=" << c.H << " G=" << c.G
                                        << " act=" << dtype_name(act));
      check_scan(rng, c, lens, slots, num_slots, 128, act);
    }
  }

  // One sequence of awkward length at the tensor-core shape: Super heads up to 989 tokens, Nano heads at
  // 4099 (33 chunks: superchunks of several chunks and a ragged last one), a non-zero initial state in slot 1.
  void awkward_lengths(DType act, std::initializer_list<int32_t> lengths) const {
    auto rng = test::Rng::for_test();
    for (int32_t T : lengths) {
      const SsmCase& c = T > 1000 ? kNano : kSuper;
      SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << c.H << " act=" << dtype_name(act));
      check_scan(rng, c, {T}, {1}, 3, 128, act);
    }
  }

#ifdef CHIMERA_HAVE_CUDA
  // Two tensor-core variants on the same inputs (activations stored as `act`) and non-zero initial states, one
  // slot per sequence: y and the final states must be identical bit for bit.
  void expect_same_bits(test::Rng& rng, const SsmCase& shape, const std::vector<int32_t>& lens, DType act,
                        const cuda::SsdOptions& a, const cuda::SsdOptions& b) const {
    const auto cu = cu_from(lens);
    const int64_t batch = static_cast<int64_t>(lens.size());
    std::vector<int32_t> slots(static_cast<size_t>(batch));
    std::iota(slots.begin(), slots.end(), 0);
    const SsmInputs d = dev(make_inputs(rng, cu.back(), shape), act);
    const Tensor state0 = rng.normal_tensor({batch, shape.H, shape.P, shape.N}, 0.5f);
    Tensor out[2][2];  // [a, b][y, state]
    for (int v = 0; v < 2; ++v) {
      const Tensor y = poisoned(act, d.x.shape()), state = dev(state0);
      cuda::SsdRunner(y, d.x, d.dt_raw, d.B, d.C, d.p, state, cu, slots, 128, nullptr, v == 0 ? a : b).run();
      out[v][0] = host_f32(y);
      out[v][1] = host_f32(state);
    }
    SCOPED_TRACE(::testing::Message() << "H=" << shape.H << " G=" << shape.G << " T=" << cu.back()
                                      << " act=" << dtype_name(act));
    EXPECT_TRUE(test::bit_equal(out[1][0], out[0][0])) << "y";
    EXPECT_TRUE(test::bit_equal(out[1][1], out[0][1])) << "final states";
  }
#endif
};

TEST_P(OpsSsd, RecurrenceMatchesNaive) {
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {1, 17, 3, 40}, slots = {2, -1, 0, 4};
  const auto cu = cu_from(lens);
  for (const SsmCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "H=" << c.H << " P=" << c.P << " G=" << c.G << " N=" << c.N);
    const SsmInputs in = make_inputs(rng, cu.back(), c);
    const Tensor state0 = rng.normal_tensor({5, c.H, c.P, c.N});
    const SsmInputs d = dev(in);
    const Tensor y_dev = poisoned(DType::kF32, in.x.shape()), state_dev = dev(state0);
    ops::ssm_recurrence(ctx(), y_dev, d.x, d.dt_raw, d.B, d.C, d.p, state_dev, cu, slots);
    Tensor y = host_f32(y_dev), state = host_f32(state_dev);
    Tensor want = Tensor::empty(DType::kF32, in.x.shape()), want_state = state0.clone();
    test::poison(want);
    naive_ssm(want, in, want_state, cu, slots);
    expect_pad_rows_untouched(y, want, cu, slots);
    EXPECT_TRUE(test::nmse_close(y, want, test::kF32ReductionNmse, test::kF32Reduction));
    EXPECT_TRUE(test::nmse_close(state, want_state, test::kF32ReductionNmse, test::kF32Reduction));
  }
}

TEST_P(OpsSsd, ChunkScanMatchesRecurrence) {
  auto rng = test::Rng::for_test();
  // Mixed lengths packed in one batch (1 token, exactly one chunk, crossing chunk boundaries, an empty one),
  // permuted non-contiguous slots and a pad. The oracle is the CPU recurrence.
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
          const SsmInputs d = dev(in);
          const Tensor y_dev = poisoned(DType::kF32, in.x.shape()), state_dev = dev(state0);
          ops::ssd_chunk_scan(ctx(), y_dev, d.x, d.dt_raw, d.B, d.C, d.p, state_dev, cu, slots, chunk);
          Tensor y = host_f32(y_dev), state = host_f32(state_dev);
          Tensor want = Tensor::empty(DType::kF32, in.x.shape()), want_state = state0.clone();
          test::poison(want);
          ops::ssm_recurrence(ops::Context{}, want, in.x, in.dt_raw, in.B, in.C, in.p, want_state, cu, slots);
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

// Checkpoints (prefix caching): each checkpoint slot holds the state a scan of the sequence's first `rows` rows
// leaves, and y and the final states are those of the scan without checkpoints (the chunk grid restarts at each
// cut, so they agree to the reduction order); on CUDA the checkpoint slots also match the CPU reference, in every
// state dtype.
TEST_P(OpsSsd, CheckpointsHoldTheStateAtTheCut) {
  auto rng = test::Rng::for_test();
  struct ScanShape {
    SsmCase c;
    int64_t chunk;
    DType act;
  };
  std::vector<ScanShape> shapes = {{kCases[1], 8, DType::kF32}, {kCases[0], 5, DType::kF32}};
  if (on_cuda()) shapes.push_back({kNano, 128, DType::kBF16});
  for (const ScanShape& sh : shapes) {
    const bool big = sh.chunk == 128;
    // Cuts one row in, at and around chunk edges, several in one sequence, none in another, next to a pad.
    const std::vector<int32_t> lens = big ? std::vector<int32_t>{300, 0, 129, 77} : std::vector<int32_t>{40, 0, 23, 17};
    const std::vector<int32_t> slots = {1, -1, 3, 0};
    const std::vector<ops::StateCheckpoint> cps =
        big ? std::vector<ops::StateCheckpoint>{{0, 1, 5}, {0, 128, 6}, {0, 200, 7}, {2, 128, 8}}
            : std::vector<ops::StateCheckpoint>{{0, 1, 5}, {0, 8, 6}, {0, 21, 7}, {2, 22, 8}};
    const auto cu = cu_from(lens);
    for (DType state_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      if (state_dtype != DType::kF32 && !on_cuda()) continue;
      SCOPED_TRACE(::testing::Message() << "H=" << sh.c.H << " chunk=" << sh.chunk << " act=" << dtype_name(sh.act)
                                        << " state=" << dtype_name(state_dtype));
      const SsmInputs ref = rounded(make_inputs(rng, cu.back(), sh.c), sh.act, DType::kF32);
      const Tensor state0 = rounded(rng.normal_tensor({10, sh.c.H, sh.c.P, sh.c.N}, 0.5f), state_dtype);
      const bool f32 = sh.act == DType::kF32 && state_dtype == DType::kF32;
      const double nmse = f32 ? test::kF32ReductionNmse : test::kBF16ReductionNmse;
      const test::Tolerance tol = f32 ? test::kF32Reduction : test::kBF16Reduction;

      const SsmInputs d = dev(ref, sh.act);
      const Tensor y = poisoned(sh.act, ref.x.shape()), state = dev(state0, state_dtype);
      ops::ssd_chunk_scan(ctx(), y, d.x, d.dt_raw, d.B, d.C, d.p, state, cu, slots, sh.chunk, cps);
      Tensor got = host_f32(y);
      const Tensor got_state = host_f32(state);

      // Without checkpoints, on the CPU reference.
      Tensor plain = Tensor::empty(DType::kF32, ref.x.shape()), plain_state = state0.clone();
      test::poison(plain);
      ops::ssd_chunk_scan(ops::Context{}, plain, ref.x, ref.dt_raw, ref.B, ref.C, ref.p, plain_state, cu, slots,
                          sh.chunk);
      expect_pad_rows_untouched(got, plain, cu, slots);
      EXPECT_TRUE(test::nmse_close(got, plain, nmse, tol)) << "y";
      for (int32_t s : {0, 1, 3}) {
        EXPECT_TRUE(test::nmse_close(got_state.select(s), plain_state.select(s), nmse, tol)) << "final state " << s;
      }
      for (int32_t s : {2, 4, 9}) EXPECT_TRUE(test::bit_equal(got_state.select(s), state0.select(s))) << "slot " << s;
      // Each checkpoint against the CPU reference's scan of the prefix alone.
      for (const ops::StateCheckpoint& k : cps) {
        const int32_t begin = cu[static_cast<size_t>(k.seq)];
        const std::vector<int32_t> slot = {slots[static_cast<size_t>(k.seq)]};
        SsmInputs prefix = ref;
        prefix.x = ref.x.rows(begin, begin + k.rows).clone();
        prefix.dt_raw = ref.dt_raw.rows(begin, begin + k.rows).clone();
        prefix.B = ref.B.rows(begin, begin + k.rows).clone();
        prefix.C = ref.C.rows(begin, begin + k.rows).clone();
        Tensor py = Tensor::empty(DType::kF32, prefix.x.shape()), pstate = state0.clone();
        ops::ssd_chunk_scan(ops::Context{}, py, prefix.x, prefix.dt_raw, prefix.B, prefix.C, prefix.p, pstate,
                            std::vector<int32_t>{0, k.rows}, slot, sh.chunk);
        EXPECT_TRUE(test::nmse_close(got_state.select(k.slot), pstate.select(slot[0]), nmse, tol))
            << "checkpoint after " << k.rows << " rows of sequence " << k.seq;
      }
      if (on_cuda()) {  // every slot, checkpoints included, against the CPU reference with the same checkpoints
        Tensor want = Tensor::empty(DType::kF32, ref.x.shape()), want_state = state0.clone();
        ops::ssd_chunk_scan(ops::Context{}, want, ref.x, ref.dt_raw, ref.B, ref.C, ref.p, want_state, cu, slots,
                            sh.chunk, cps);
        for (const ops::StateCheckpoint& k : cps) {
          EXPECT_TRUE(test::nmse_close(got_state.select(k.slot), want_state.select(k.slot), nmse, tol))
              << "CUDA checkpoint after " << k.rows << " rows of sequence " << k.seq;
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
  const Tensor state0 = rng.normal_tensor({1, c.H, c.P, c.N});
  const SsmInputs d = dev(in);
  const Tensor y_dev = poisoned(DType::kF32, in.x.shape()), state_dev = dev(state0);
  ops::ssd_chunk_scan(ctx(), y_dev, d.x, d.dt_raw, d.B, d.C, d.p, state_dev, cu, slots, 8);
  Tensor want = Tensor::empty(DType::kF32, in.x.shape()), want_state = state0.clone();
  naive_ssm(want, in, want_state, cu, slots);
  EXPECT_TRUE(test::nmse_close(host_f32(y_dev), want, test::kF32ReductionNmse, test::kF32Reduction));
  EXPECT_TRUE(test::nmse_close(host_f32(state_dev), want_state, test::kF32ReductionNmse, test::kF32Reduction));
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
  // The prefill runs on the backend under test; the decode steps on the CPU reference from the state the
  // prefill left (selective_state_update's CUDA kernel has its own tests).
  Tensor state;
  const std::vector<int32_t> zeros(3, 0);
  {
    SsmInputs pre;
    pre.x = gather(all.x, zeros, prefill);
    pre.dt_raw = gather(all.dt_raw, zeros, prefill);
    pre.B = gather(all.B, zeros, prefill);
    pre.C = gather(all.C, zeros, prefill);
    pre.p = all.p;
    const SsmInputs d = dev(pre);
    const Tensor y = poisoned(DType::kF32, pre.x.shape()), state_dev = dev(state0);
    ops::ssd_chunk_scan(ctx(), y, d.x, d.dt_raw, d.B, d.C, d.p, state_dev, cu_from(prefill), slots, 4);
    EXPECT_TRUE(
        test::nmse_close(host_f32(y), gather(want, zeros, prefill), test::kF32ReductionNmse, test::kF32Reduction));
    state = host_f32(state_dev);
  }
  for (int64_t step = 0; step < steps; ++step) {
    const std::vector<int32_t> ones(3, 1);
    std::vector<int32_t> at(prefill);
    for (auto& a : at) a += int32_t(step);
    const Tensor x = gather(all.x, at, ones), dt = gather(all.dt_raw, at, ones);
    const Tensor B = gather(all.B, at, ones), C = gather(all.C, at, ones);
    Tensor y = Tensor::empty(DType::kF32, x.shape());
    test::poison(y);
    ops::selective_state_update(ops::Context{}, y, x, dt, B, C, all.p, state, slots);
    EXPECT_TRUE(test::nmse_close(y, gather(want, at, ones), test::kF32ReductionNmse, test::kF32Reduction))
        << "step " << step;
  }
  EXPECT_TRUE(test::nmse_close(state, want_state, test::kF32ReductionNmse, test::kF32Reduction));
}

TEST_P(OpsSsd, SelectiveStateUpdateSkipsPad) {
  if (on_cuda()) GTEST_SKIP() << "selective_state_update on CUDA is covered by the SSU tests";
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
  const SsmInputs in = dev(make_inputs(rng, 6, {4, 8, 2, 16}));
  const Tensor y = poisoned(DType::kF32, in.x.shape()), state = dev(Tensor::zeros(DType::kF32, {2, 4, 8, 16}));
  const std::vector<int32_t> cu = {0, 6}, slot = {1};
  const Tensor B3 = dev(Tensor::zeros(DType::kF32, {6, 3, 16}));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::ssd_chunk_scan(ctx(), y, in.x, in.dt_raw, B3, B3, in.p, state, cu, slot, 4); }, ErrorKind::kRuntime,
      "ops::ssd_chunk_scan: B F32[6, 3, 16] has 3 groups, which do not divide the 4 heads of x F32[6, 4, 8]"));
  EXPECT_TRUE(
      test::throws_error([&] { ops::ssd_chunk_scan(ctx(), y, in.x, in.dt_raw, in.B, in.C, in.p, state, cu, slot, 0); },
                         ErrorKind::kRuntime, "ops::ssd_chunk_scan: chunk_size 0 must be positive"));
  const Tensor bad_state = dev(Tensor::zeros(DType::kF32, {2, 4, 8, 15}));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::ssm_recurrence(ctx(), y, in.x, in.dt_raw, in.B, in.C, in.p, bad_state, cu, slot); },
      ErrorKind::kRuntime, "ops::ssm_recurrence: ssm_state F32[2, 4, 8, 15] does not match x F32[6, 4, 8]"));
  ops::SsmParams p = in.p;
  p.D = dev(Tensor::zeros(DType::kF32, {3}));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::selective_state_update(ctx(), y, in.x, in.dt_raw, in.B, in.C, p, state, std::vector<int32_t>(6, -1));
      },
      ErrorKind::kRuntime, "ops::selective_state_update: D F32[3] does not match x"));
}

// ---- CUDA-only cases -------------------------------------------------------------------------------------

TEST_P(OpsSsd, CudaBf16AwkwardTokenCounts) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are a CUDA path";
  awkward_lengths(DType::kBF16, {1, 3, 17, 111});
}

TEST_P(OpsSsd, CudaBf16Prompt989) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are a CUDA path";
  awkward_lengths(DType::kBF16, {989});
}

TEST_P(OpsSsd, CudaBf16Prompt4099) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are a CUDA path";
  awkward_lengths(DType::kBF16, {4099});
}

TEST_P(OpsSsd, CudaF32AwkwardTokenCounts) {
  if (!on_cuda()) GTEST_SKIP() << "the CPU instance is the reference itself";
  awkward_lengths(DType::kF32, {1, 3, 17, 111, 989});
}

TEST_P(OpsSsd, CudaF32Prompt4099) {
  if (!on_cuda()) GTEST_SKIP() << "the CPU instance is the reference itself";
  awkward_lengths(DType::kF32, {4099});
}

// Packed batches of 1 to 64 sequences of mixed lengths (0, 1, exact chunk multiples, crossing chunk
// boundaries), permuted slots drawn from a larger pool with pads, every slot holding a non-zero state;
// odd heads per group and n_groups 1, 2 and 8.
struct BatchCase {
  int64_t batch;
  SsmCase shape;
  int32_t max_len;
};

void packed_batches(const OpsSsd& t, std::initializer_list<DType> acts) {
  auto rng = test::Rng::for_test();
  const BatchCase cases[] = {{1, {24, 64, 8, 128}, 400}, {17, {10, 64, 2, 128}, 300}, {64, {7, 64, 1, 128}, 100}};
  for (const BatchCase& b : cases) {
    std::vector<int32_t> lens;
    const int32_t fixed[] = {0, 1, 128, 129, 256, 127};
    for (int64_t s = 0; s < b.batch; ++s) {
      lens.push_back(s < 6 && b.batch > 1 ? fixed[s] : static_cast<int32_t>(rng.integer(1, b.max_len)));
    }
    t.run_batch(rng, b.shape, lens, acts);
  }
}

TEST_P(OpsSsd, CudaPackedBatchesMixedLengths) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are a CUDA path";
  packed_batches(*this, {DType::kBF16, DType::kF32});
}

// A batch whose chunk count makes the tensor-core path group chunks into superchunks (of 2 here) across
// several sequences, with a pad of 128 tokens and an empty sequence (bf16: the f32 path has no superchunks).
TEST_P(OpsSsd, CudaPackedBatchSuperchunks) {
  if (!on_cuda()) GTEST_SKIP() << "bf16 activations are a CUDA path";
  auto rng = test::Rng::for_test();
  run_batch(rng, kNano, {0, 1, 128, 1000, 700, 129, 300}, {DType::kBF16});
}

// 16-bit storage everywhere else: bf16 states, f16 activations, bf16 parameters (as HF loads A_log, D and
// dt_bias), the dt limits on the tensor-core path, and 16-bit inputs on the portable path (small shapes).
TEST_P(OpsSsd, CudaSixteenBitStatesActivationsAndParams) {
  if (!on_cuda()) GTEST_SKIP() << "16-bit activations and states are a CUDA path";
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {300, 0, 129, 1}, slots = {2, 0, -1, 4};
  {
    SCOPED_TRACE("bf16 activations, bf16 state");
    check_scan(rng, kNano, lens, slots, 6, 128, DType::kBF16, DType::kBF16);
  }
  {
    SCOPED_TRACE("f16 activations, f16 state, bf16 parameters");
    check_scan(rng, {16, 64, 2, 128}, lens, slots, 6, 128, DType::kF16, DType::kF16, DType::kBF16);
  }
  {
    SCOPED_TRACE("bf16 activations, dt limits");
    check_scan(rng, {16, 64, 8, 128}, lens, slots, 6, 128, DType::kBF16, DType::kF32, DType::kF32, 0.02f, 0.08f);
  }
  for (const SsmCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "portable bf16, H=" << c.H << " P=" << c.P << " N=" << c.N);
    check_scan(rng, c, lens, slots, 6, 16, DType::kBF16, DType::kBF16);
  }
  {
    SCOPED_TRACE("tensor-core shape, chunk 64 (portable)");
    check_scan(rng, {8, 64, 2, 128}, lens, slots, 6, 64, DType::kBF16);
  }
}

// The recurrence oracle itself with 16-bit activations and states against the CPU recurrence.
TEST_P(OpsSsd, CudaRecurrenceSixteenBit) {
  if (!on_cuda()) GTEST_SKIP() << "16-bit activations are a CUDA path";
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {40, 3, 0, 17}, slots = {1, -1, 3, 0};
  const auto cu = cu_from(lens);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const SsmCase c{8, 64, 2, 128};
    SCOPED_TRACE(::testing::Message() << "dtype=" << dtype_name(dt));
    const SsmInputs in = rounded(make_inputs(rng, cu.back(), c), dt, DType::kF32);
    const Tensor state0 = rounded(rng.normal_tensor({4, c.H, c.P, c.N}, 0.5f), dt);
    Tensor want = Tensor::empty(DType::kF32, in.x.shape()), want_state = state0.clone();
    test::poison(want);
    ops::ssm_recurrence(ops::Context{}, want, in.x, in.dt_raw, in.B, in.C, in.p, want_state, cu, slots);
    const SsmInputs d = dev(in, dt);
    const Tensor y = poisoned(dt, in.x.shape()), state = dev(state0, dt);
    ops::ssm_recurrence(ctx(), y, d.x, d.dt_raw, d.B, d.C, d.p, state, cu, slots);
    Tensor got = host_f32(y);
    const Tensor got_state = host_f32(state);
    expect_pad_rows_untouched(got, want, cu, slots);
    EXPECT_TRUE(test::nmse_close(got, want, test::kBF16ReductionNmse, test::kBF16Reduction));
    EXPECT_TRUE(test::nmse_close(got_state, want_state, test::kBF16ReductionNmse, test::kBF16Reduction));
    expect_unused_slots_kept(got_state, state0, lens, slots);
  }
}

#ifdef CHIMERA_HAVE_CUDA
// ---- the tensor-core path's options (cuda::SsdOptions) ------------------------------------------------------
// Against the CPU reference on the cases above: awkward single prompts (non-zero state from slot 1), packed
// batches with pads, empty prompts and odd heads per group (3, 5, 7: the second head of a block idle), chunk-
// crossing lengths, 16-bit states / activations / parameters, dt limits; superchunks of 1 (no state step in the
// scan) and 3 (odd) as well as the automatic length.
// The tensor-core option cases (the caller sets `variant`): a 4099-token prompt and a packed batch with pads; with
// `all` also short and chunk-crossing prompts, packed batches, 16-bit states / activations / parameters, dt limits.
void variant_reference_cases(OpsSsd& t, bool all) {
  t.awkward_lengths(DType::kBF16, {4099});
  auto rng = test::Rng::for_test();
  t.run_batch(rng, kNano, {0, 1, 128, 1000, 700, 129, 300}, {DType::kBF16});
  if (!all) return;
  t.awkward_lengths(DType::kBF16, {1, 3, 17, 111, 989});
  packed_batches(t, {DType::kBF16});
  const std::vector<int32_t> lens = {300, 0, 129, 1}, slots = {2, 0, -1, 4};
  t.check_scan(rng, kNano, lens, slots, 6, 128, DType::kBF16, DType::kBF16);
  t.check_scan(rng, {16, 64, 2, 128}, lens, slots, 6, 128, DType::kF16, DType::kF16, DType::kBF16);
  t.check_scan(rng, {16, 64, 8, 128}, lens, slots, 6, 128, DType::kBF16, DType::kF32, DType::kF32, 0.02f, 0.08f);
}

// The tensor-core path at forced superchunk lengths against the CPU reference: 1 (no state step in the scan), 3
// (odd) and automatic; awkward single prompts, packed batches with pads and odd heads per group, 16-bit states /
// activations / parameters, dt limits.
TEST_P(OpsSsd, CudaSuperchunkLengthsMatchReference) {
  if (!on_cuda()) GTEST_SKIP() << "a CUDA option";
  for (int m : {0, 1, 3}) {
    SCOPED_TRACE(::testing::Message() << "superchunk=" << m);
    variant = cuda::SsdOptions{.superchunk = m};
    variant_reference_cases(*this, m == 0);
  }
}

// Small enough for compute-sanitizer (memcheck; racecheck / synccheck: the scan block writes sb, x * w and the
// C.B^T fragments in shared memory that other warps read, and refills the other copy stage while computing).
TEST_P(OpsSsd, CudaScanSmall) {
  if (!on_cuda()) GTEST_SKIP() << "a CUDA option";
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {300, 0, 129, 1, 256}, slots = {2, 0, -1, 4, 1};
  variant = cuda::SsdOptions{.superchunk = 2};
  check_scan(rng, {4, 64, 2, 128}, lens, slots, 6, 128, DType::kBF16);
  check_scan(rng, {3, 64, 1, 128}, lens, slots, 6, 128, DType::kF16);
}

// The tensor-core path is deterministic: the same inputs twice give the same bits (fixed mma chains, no atomics).
TEST_P(OpsSsd, CudaScanRepeatsItsBits) {
  if (!on_cuda()) GTEST_SKIP() << "a CUDA option";
  auto rng = test::Rng::for_test();
  const cuda::SsdOptions def;
  expect_same_bits(rng, kSuper, {989}, DType::kBF16, def, def);
  expect_same_bits(rng, kNano, {0, 1, 128, 1000, 700, 129, 300}, DType::kBF16, def, def);
  expect_same_bits(rng, {12, 64, 4, 128}, {1500, 77}, DType::kF16, def, def);
}
#endif

// Mixed dtypes in one call fail loudly on CUDA.
TEST_P(OpsSsd, CudaRejectsMixedActivationDtypes) {
  if (!on_cuda()) GTEST_SKIP() << "the CPU reference takes F32 only";
  auto rng = test::Rng::for_test();
  const SsmInputs in = make_inputs(rng, 5, {4, 8, 2, 16});
  SsmInputs d = dev(in, DType::kBF16);
  d.C = dev(in.C, DType::kF32);
  const Tensor y = poisoned(DType::kBF16, in.x.shape()), state = dev(Tensor::zeros(DType::kF32, {1, 4, 8, 16}));
  const std::vector<int32_t> cu = {0, 5}, slot = {0};
  EXPECT_TRUE(test::throws_error(
      [&] { ops::ssd_chunk_scan(ctx(), y, d.x, d.dt_raw, d.B, d.C, d.p, state, cu, slot, 4); }, ErrorKind::kRuntime,
      "ops::ssd_chunk_scan: CUDA needs one activation dtype per call"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsSsd);

}  // namespace
}  // namespace chimera
