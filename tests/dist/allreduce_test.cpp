// 2-GPU tests of the fused AllReduce (src/dist/allreduce.h) against a CPU fp32 reference: every fusion pattern x
// {bf16, fp32} x hidden {128, 2688, 8192} x tokens {1, 7, 129, 1000} for ONESHOT, TWOSHOT and NCCL; 1,000
// consecutive calls with changing shapes and data; -0.0 and NaN inputs; one rank delayed; CUDA graph capture +
// 100 replays; a message over the workspace falling back to NCCL. Skips unless the build has NCCL and the
// machine has >= 2 GPUs with peer access. Outputs are poisoned (0xff: NaN) before every call, and both ranks'
// outputs must be bit-identical (every strategy sums in one fixed order).
#include <gtest/gtest.h>

#if defined(CHIMERA_HAVE_NCCL)

#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "common/compare.h"
#include "common/tolerances.h"
#include "core/dtype.h"
#include "dist/allreduce.h"
#include "dist/strategy.h"

namespace chimera::dist {
namespace {

using test::Tolerance;

constexpr int kRanks = 2;
constexpr int64_t kMaxTokens = 1000, kMaxHidden = 8192;
constexpr size_t kMaxBytes = static_cast<size_t>(kMaxTokens * kMaxHidden * 4);
constexpr float kEps = 1e-5f;
constexpr float kFp8Scale = 1.0f / 16.0f;  // quantised values up to ~80: exercises the scale, stays < 448

// Fast deterministic inputs in [-1, -0.05] U [0.05, 1] (never zero, so a lost element cannot pass as 0).
struct SplitMix {
  uint64_t s;
  float next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) / static_cast<float>(1 << 24);  // [0, 1)
    const float m = 0.05f + 0.95f * u;
    return (z & 1u) ? m : -m;
  }
};

// Host data of one call: every rank's input and residual, the weight, as values already rounded to `dtype`.
struct CallData {
  DType dtype;
  int64_t tokens, hidden;
  std::vector<std::vector<float>> input;  // [rank][tokens * hidden]
  std::vector<std::vector<float>> residual;
  std::vector<float> weight;
};

std::vector<float> rounded(std::vector<float> v, DType t) {
  std::vector<uint8_t> bytes(v.size() * dtype_size(t));
  convert_from_f32(v.data(), t, bytes.data(), v.size());
  convert_to_f32(bytes.data(), t, v.data(), v.size());
  return v;
}

CallData make_data(DType t, int64_t tokens, int64_t hidden, uint64_t seed) {
  CallData d{t, tokens, hidden, {}, {}, {}};
  SplitMix rng{seed};
  const size_t n = static_cast<size_t>(tokens * hidden);
  for (int r = 0; r < kRanks; ++r) {
    std::vector<float> in(n), res(n);
    for (float& x : in) x = rng.next();
    for (float& x : res) x = 2.0f * rng.next();
    d.input.push_back(rounded(std::move(in), t));
    d.residual.push_back(rounded(std::move(res), t));
  }
  std::vector<float> w(static_cast<size_t>(hidden));
  for (float& x : w) x = 1.0f + 0.5f * rng.next();
  d.weight = rounded(std::move(w), t);
  return d;
}

// The fp32 reference: sum over ranks, + residual (rank 0's; every rank passes its own copy of the same
// residual in the model, so the tests give both ranks rank 0's), RMSNorm.
struct Reference {
  std::vector<float> sum, residual_out, norm_res, norm_plain;  // norm of residual_out / of sum
};
Reference reference(const CallData& d) {
  const size_t n = static_cast<size_t>(d.tokens * d.hidden);
  Reference ref;
  ref.sum.assign(n, 0.0f);
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < n; ++i) ref.sum[i] += d.input[static_cast<size_t>(r)][i];
  ref.residual_out.resize(n);
  for (size_t i = 0; i < n; ++i) ref.residual_out[i] = ref.sum[i] + d.residual[0][i];
  auto norm = [&](const std::vector<float>& x, std::vector<float>& out) {
    out.resize(n);
    for (int64_t t = 0; t < d.tokens; ++t) {
      const float* row = x.data() + t * d.hidden;
      double ss = 0.0;
      for (int64_t c = 0; c < d.hidden; ++c) ss += static_cast<double>(row[c]) * row[c];
      const float rinv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d.hidden) + kEps));
      for (int64_t c = 0; c < d.hidden; ++c) out[static_cast<size_t>(t * d.hidden + c)] = row[c] * rinv * d.weight[static_cast<size_t>(c)];
    }
  };
  norm(ref.residual_out, ref.norm_res);
  norm(ref.sum, ref.norm_plain);
  return ref;
}

std::string fmt_case(DType t, int64_t hidden, int64_t tokens, AllReduceStrategy s, FusionPattern p) {
  return std::string(dtype_name(t)) + " hidden " + std::to_string(hidden) + " tokens " + std::to_string(tokens) +
         " " + std::string(strategy_name(s)) + " " + std::string(pattern_name(p));
}

Tolerance tolerance(DType t) { return t == DType::kF32 ? test::kF32Elementwise : test::kBF16Elementwise; }

// One rank's device buffers, sized for the largest case.
struct RankBuffers {
  void* input = nullptr;
  void* residual_in = nullptr;
  void* residual_out = nullptr;
  void* norm_out = nullptr;
  void* fp8_out = nullptr;
  void* output = nullptr;
  void* weight = nullptr;
  cudaStream_t stream = nullptr;
};

// What one call produced on one rank, as host fp32 (fp8 decoded and divided by nothing: quantised domain).
struct RankResult {
  AllReduceStrategy strategy = AllReduceStrategy::kAuto;
  std::vector<float> residual_out, norm_out, fp8_q, output;
};

class AllReduceTwoGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < kRanks) {
      skip_ = "needs 2 GPUs";
      return;
    }
    int can01 = 0, can10 = 0;
    cudaDeviceCanAccessPeer(&can01, 0, 1);
    cudaDeviceCanAccessPeer(&can10, 1, 0);
    if (!can01 || !can10) {
      skip_ = "GPUs 0 and 1 have no peer access";
      return;
    }
    comm_ = Communicator::create_local({0, 1}).release();
    topo_ = new Topology(detect_topology(comm_->devices()));
    std::printf("%s", topo_->describe().c_str());
    for (AllReduceStrategy s : {AllReduceStrategy::kAuto, AllReduceStrategy::kNccl, AllReduceStrategy::kOneShot,
                                AllReduceStrategy::kTwoShot}) {
      AllReduceConfig c;
      c.strategy = s;
      c.max_message_bytes = static_cast<int64_t>(kMaxBytes);
      fusion_[s] = new AllReduceFusion(*comm_, *topo_, c);
    }
    for (int r = 0; r < kRanks; ++r) {
      RankBuffers& b = buffers_[r];
      cudaSetDevice(r);
      for (void** p : {&b.input, &b.residual_in, &b.residual_out, &b.norm_out, &b.output}) cudaMalloc(p, kMaxBytes);
      cudaMalloc(&b.fp8_out, kMaxBytes / 2);
      cudaMalloc(&b.weight, static_cast<size_t>(kMaxHidden) * 4);
      cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking);
    }
  }
  static void TearDownTestSuite() {
    for (auto& [s, f] : fusion_) delete f;
    fusion_.clear();
    if (!comm_) return;
    for (int r = 0; r < kRanks; ++r) {
      RankBuffers& b = buffers_[r];
      cudaSetDevice(r);
      for (void* p : {b.input, b.residual_in, b.residual_out, b.norm_out, b.output, b.fp8_out, b.weight}) cudaFree(p);
      cudaStreamDestroy(b.stream);
    }
    delete topo_;
    delete comm_;
    comm_ = nullptr;
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }

  static void upload(const std::vector<float>& v, DType t, void* dst) {
    std::vector<uint8_t> bytes(v.size() * dtype_size(t));
    convert_from_f32(v.data(), t, bytes.data(), v.size());
    ASSERT_EQ(cudaMemcpy(dst, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  static std::vector<float> download(const void* src, DType t, size_t n) {
    std::vector<uint8_t> bytes(n * dtype_size(t));
    cudaMemcpy(bytes.data(), src, bytes.size(), cudaMemcpyDeviceToHost);
    std::vector<float> v(n);
    convert_to_f32(bytes.data(), t, v.data(), n);
    return v;
  }

  static AllReduceParams params_for(int r, const CallData& d, FusionPattern pattern, bool in_place) {
    const RankBuffers& b = buffers_[r];
    AllReduceParams p;
    p.pattern = pattern;
    p.dtype = d.dtype;
    p.tokens = d.tokens;
    p.hidden = d.hidden;
    p.input = b.input;
    p.residual_in = b.residual_in;
    p.residual_out = in_place ? b.residual_in : b.residual_out;
    p.norm_out = b.norm_out;
    p.fp8_out = b.fp8_out;
    p.output = b.output;
    p.norm_weight = b.weight;
    p.eps = kEps;
    p.fp8_scale = kFp8Scale;
    return p;
  }

  // Uploads d, poisons outputs, runs one call on both ranks (rank `delayed` starts 200 ms late), downloads.
  static std::vector<RankResult> run_call(AllReduceFusion& ar, const CallData& d, FusionPattern pattern,
                                          bool in_place = false, int delayed = -1) {
    std::vector<RankResult> out(kRanks);
    comm_->run_ranks([&](int r) {
      prepare(r, d, in_place);
      if (r == delayed) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      out[static_cast<size_t>(r)].strategy = ar.run(r, params_for(r, d, pattern, in_place), buffers_[r].stream);
      finish(r, d, in_place, out[static_cast<size_t>(r)]);
    });
    return out;
  }
  static void prepare(int r, const CallData& d, bool in_place) {
    const RankBuffers& b = buffers_[r];
    const size_t bytes = static_cast<size_t>(d.tokens * d.hidden) * dtype_size(d.dtype);
    upload(d.input[static_cast<size_t>(r)], d.dtype, b.input);
    upload(d.residual[0], d.dtype, b.residual_in);
    upload(d.weight, d.dtype, b.weight);
    for (void* p : {b.norm_out, b.output}) cudaMemset(p, 0xff, bytes);
    if (!in_place) cudaMemset(b.residual_out, 0xff, bytes);
    cudaMemset(b.fp8_out, 0xff, static_cast<size_t>(d.tokens * d.hidden));
  }
  static void finish(int r, const CallData& d, bool in_place, RankResult& res) {
    const RankBuffers& b = buffers_[r];
    if (cudaStreamSynchronize(b.stream) != cudaSuccess || cudaGetLastError() != cudaSuccess) {
      throw std::runtime_error("rank " + std::to_string(r) + ": stream failed");
    }
    const size_t n = static_cast<size_t>(d.tokens * d.hidden);
    res.residual_out = download(in_place ? b.residual_in : b.residual_out, d.dtype, n);
    res.norm_out = download(b.norm_out, d.dtype, n);
    res.output = download(b.output, d.dtype, n);
    std::vector<float> q = download(b.fp8_out, DType::kF8E4M3, n);
    res.fp8_q = std::move(q);
  }

  // Checks what `pattern` writes against the reference, on both ranks, and that the ranks agree bit for bit.
  static void expect_matches(const std::vector<RankResult>& got, const CallData& d, const Reference& ref,
                             FusionPattern pattern) {
    const Tolerance tol = tolerance(d.dtype);
    // The FP8 output is quantised from the same fp32 norm the norm output comes from, so its error is the norm's
    // (in the quantised domain: divided by the scale) plus one e4m3 step. Comparing it with the e4m3 step alone
    // (as the first H200 run did) fails where the bf16-rounded all-reduced sum nearly cancels the residual: the
    // worst element of every failing case in that run had |norm| < 0.008 (O(1) terms cancelling to O(0.005),
    // so the 2^-9 rounding of the sum is a large part of it), while the norm output passed its bf16 bound.
    // Not yet re-run on a GPU with this bound.
    const Tolerance fp8_tol{tol.abs / kFp8Scale + test::kF8E4M3Quant.abs, tol.rel + test::kF8E4M3Quant.rel};
    std::vector<float> ref_q;
    if (has_fp8_out(pattern)) {
      ref_q.resize(ref.norm_res.size());
      for (size_t i = 0; i < ref_q.size(); ++i) ref_q[i] = ref.norm_res[i] / kFp8Scale;
    }
    for (int r = 0; r < kRanks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      const RankResult& g = got[static_cast<size_t>(r)];
      if (pattern == FusionPattern::kAllReduce) { EXPECT_ALL_CLOSE(g.output, ref.sum, tol); }
      if (has_residual(pattern)) { EXPECT_ALL_CLOSE(g.residual_out, ref.residual_out, tol); }
      if (has_norm_out(pattern)) {
        EXPECT_ALL_CLOSE(g.norm_out, pattern == FusionPattern::kRmsNorm ? ref.norm_plain : ref.norm_res, tol);
      }
      if (has_fp8_out(pattern)) { EXPECT_ALL_CLOSE(g.fp8_q, ref_q, fp8_tol); }
    }
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    EXPECT_TRUE(same(got[0].output, got[1].output) && same(got[0].residual_out, got[1].residual_out) &&
                same(got[0].norm_out, got[1].norm_out) && same(got[0].fp8_q, got[1].fp8_q))
        << "ranks disagree";
  }

  static inline std::string skip_;
  static inline Communicator* comm_ = nullptr;
  static inline Topology* topo_ = nullptr;
  static inline std::map<AllReduceStrategy, AllReduceFusion*> fusion_;
  static inline RankBuffers buffers_[kRanks];
};

constexpr FusionPattern kPatterns[] = {FusionPattern::kAllReduce, FusionPattern::kResidualRmsNorm,
                                       FusionPattern::kResidualRmsNormFp8, FusionPattern::kResidualRmsNormOutFp8,
                                       FusionPattern::kRmsNorm};

TEST_F(AllReduceTwoGpu, EveryPatternDtypeShapeAndStrategy) {
  uint64_t seed = 1;
  for (DType t : {DType::kBF16, DType::kF32}) {
    for (int64_t hidden : {128, 2688, 8192}) {
      for (int64_t tokens : {1, 7, 129, 1000}) {
        const CallData d = make_data(t, tokens, hidden, seed++);
        const Reference ref = reference(d);
        for (AllReduceStrategy s : {AllReduceStrategy::kOneShot, AllReduceStrategy::kTwoShot,
                                    AllReduceStrategy::kNccl, AllReduceStrategy::kAuto}) {
          for (FusionPattern pattern : kPatterns) {
            SCOPED_TRACE(fmt_case(t, hidden, tokens, s, pattern));
            const auto got = run_call(*fusion_[s], d, pattern);
            if (s != AllReduceStrategy::kAuto) { ASSERT_EQ(got[0].strategy, s); }
            expect_matches(got, d, ref, pattern);
            if (HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST_F(AllReduceTwoGpu, ThousandConsecutiveCallsChangingShapeAndData) {
  // Changing token counts make every Lamport clear cover a different extent; the residual is updated in place.
  const int64_t tokens_cycle[] = {1, 7, 64, 3, 129};
  for (AllReduceStrategy s : {AllReduceStrategy::kOneShot, AllReduceStrategy::kTwoShot}) {
    for (int call = 0; call < 1000; ++call) {
      const int64_t tokens = tokens_cycle[call % 5];
      const CallData d = make_data(DType::kBF16, tokens, 2688, 1000 + static_cast<uint64_t>(call));
      const auto got = run_call(*fusion_[s], d, FusionPattern::kResidualRmsNorm, /*in_place=*/true);
      SCOPED_TRACE(std::string(strategy_name(s)) + " call " + std::to_string(call));
      expect_matches(got, d, reference(d), FusionPattern::kResidualRmsNorm);
      if (HasFailure()) return;
    }
  }
}

TEST_F(AllReduceTwoGpu, NegativeZeroAndNanInputs) {
  for (AllReduceStrategy s : {AllReduceStrategy::kOneShot, AllReduceStrategy::kTwoShot, AllReduceStrategy::kNccl}) {
    for (DType t : {DType::kBF16, DType::kF32}) {
      CallData d = make_data(t, 7, 2688, 77);
      // Row 1 all -0.0 on both ranks (a reader that took -0.0 for "not arrived" would hang here); scattered
      // -0.0 in row 2; one NaN in row 4 of rank 0 (its norm row is all NaN, as in the reference).
      for (int r = 0; r < kRanks; ++r) {
        auto& in = d.input[static_cast<size_t>(r)];
        for (int64_t c = 0; c < d.hidden; ++c) in[static_cast<size_t>(d.hidden + c)] = -0.0f;
        for (int64_t c = 0; c < d.hidden; c += 3) in[static_cast<size_t>(2 * d.hidden + c)] = -0.0f;
      }
      d.input[0][static_cast<size_t>(4 * d.hidden + 5)] = std::nanf("");
      if (t == DType::kF32) d.input[1][10] = f32_from_bits(0x80008000u);  // the fp32 empty pattern itself
      SCOPED_TRACE(std::string(strategy_name(s)) + " " + std::string(dtype_name(t)));
      const Reference ref = reference(d);
      for (FusionPattern pattern : {FusionPattern::kAllReduce, FusionPattern::kResidualRmsNorm}) {
        expect_matches(run_call(*fusion_[s], d, pattern), d, ref, pattern);
      }
    }
  }
}

TEST_F(AllReduceTwoGpu, OneRankDelayed) {
  for (AllReduceStrategy s : {AllReduceStrategy::kOneShot, AllReduceStrategy::kTwoShot, AllReduceStrategy::kNccl}) {
    for (int delayed = 0; delayed < kRanks; ++delayed) {
      const CallData d = make_data(DType::kBF16, 64, 8192, 5 + static_cast<uint64_t>(delayed));
      SCOPED_TRACE(std::string(strategy_name(s)) + " rank " + std::to_string(delayed) + " late");
      expect_matches(run_call(*fusion_[s], d, FusionPattern::kResidualRmsNorm, false, delayed), d, reference(d),
                     FusionPattern::kResidualRmsNorm);
    }
  }
}

TEST_F(AllReduceTwoGpu, GraphCaptureAndHundredReplays) {
  for (AllReduceStrategy s : {AllReduceStrategy::kOneShot, AllReduceStrategy::kTwoShot}) {
    SCOPED_TRACE(std::string(strategy_name(s)));
    const FusionPattern pattern = FusionPattern::kResidualRmsNormOutFp8;
    CallData d = make_data(DType::kBF16, 32, 4096, 300);
    cudaGraphExec_t exec[kRanks] = {};
    comm_->run_ranks([&](int r) {
      cudaStream_t st = buffers_[r].stream;
      cudaGraph_t graph = nullptr;
      if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess) throw std::runtime_error("capture");
      fusion_[s]->run(r, params_for(r, d, pattern, false), st);
      if (cudaStreamEndCapture(st, &graph) != cudaSuccess) throw std::runtime_error("end capture");
      if (cudaGraphInstantiate(&exec[r], graph, 0) != cudaSuccess) throw std::runtime_error("instantiate");
      cudaGraphDestroy(graph);
    });
    for (int replay = 0; replay < 100; ++replay) {
      d = make_data(DType::kBF16, 32, 4096, 400 + static_cast<uint64_t>(replay));
      std::vector<RankResult> got(kRanks);
      comm_->run_ranks([&](int r) {
        prepare(r, d, false);
        if (cudaGraphLaunch(exec[r], buffers_[r].stream) != cudaSuccess) throw std::runtime_error("launch");
        finish(r, d, false, got[static_cast<size_t>(r)]);
      });
      SCOPED_TRACE("replay " + std::to_string(replay));
      expect_matches(got, d, reference(d), pattern);
      if (HasFailure()) break;
    }
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(r);
      cudaGraphExecDestroy(exec[r]);
    }
    if (HasFailure()) return;
  }
}

TEST_F(AllReduceTwoGpu, OverWorkspaceFallsBackToNccl) {
  AllReduceConfig c;
  c.strategy = AllReduceStrategy::kOneShot;
  c.max_message_bytes = 1 << 20;
  AllReduceFusion small(*comm_, *topo_, c);
  const CallData d = make_data(DType::kBF16, 129, 8192, 9);  // 2 MiB > 1 MiB
  const Reference ref = reference(d);
  for (FusionPattern pattern : kPatterns) {
    for (bool in_place : {false, true}) {  // in place + no norm_out (pattern Fp8): the sum needs NCCL scratch
      SCOPED_TRACE(std::string(pattern_name(pattern)) + (in_place ? " in place" : ""));
      const auto got = run_call(small, d, pattern, in_place);
      EXPECT_EQ(got[0].strategy, AllReduceStrategy::kNccl);
      expect_matches(got, d, ref, pattern);
    }
  }
  const CallData fits = make_data(DType::kBF16, 7, 8192, 10);
  EXPECT_EQ(run_call(small, fits, FusionPattern::kResidualRmsNorm)[0].strategy, AllReduceStrategy::kOneShot);
}

}  // namespace
}  // namespace chimera::dist

#else

TEST(AllReduceTwoGpu, Skipped) { GTEST_SKIP() << "built without CUDA + NCCL"; }

#endif
