// 2-GPU tests of the fused AllReduce (src/dist/allreduce.h) against a CPU fp32 reference:
//  * the grid: every fusion pattern x {bf16, fp16, fp32} x hidden {128, 2688, 4096, 4480, 8192, 16384} x tokens
//    {1, 2, 7, 64, 128, 129, 1000, 4096} x {ONESHOT, TWOSHOT, NCCL, AUTO}, one summary line per pattern;
//  * 10,000 consecutive calls with fresh data, each checked, shapes / dtypes / patterns / strategies changing
//    (AUTO alternates ONESHOT and TWOSHOT in one workspace; the Lamport slots see every dtype in turn);
//  * -0.0 and NaN inputs; one rank delayed; CUDA graph capture + 1,000 replays with fresh data; a message over the
//    workspace falling back to NCCL;
//  * 200 calls of changing sizes enqueued back to back without a host sync (the only place consecutive kernels
//    overlap under programmatic dependent launch), PDL on and off, checked through an in-place residual chain.
// Skips unless the build has NCCL and the machine has >= 2 GPUs with peer access.
//
// Outputs are poisoned (0xff: NaN in every dtype, e4m3 included) before every call. Rank 0's outputs are compared
// with the reference on GPU 0 (src/backends/cuda/dist/check.h: the grid writes ~10^11 elements, too many to copy
// back), and rank 1's must equal rank 0's bit for bit (every strategy sums in one fixed order). Inputs come from a
// counter-based hash (any element of any call is computable alone, so generation runs on every core), rounded to
// the dtype before the reference sees them.
#include <gtest/gtest.h>

#if defined(CHIMERA_HAVE_NCCL)

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/dist/check.h"
#include "backends/device_api.h"
#include "common/tolerances.h"
#include "core/dtype.h"
#include "dist/allreduce.h"
#include "dist/strategy.h"

namespace chimera::dist {
namespace {

using cuda::dist::CloseReport;
using test::Tolerance;

constexpr int kRanks = 2;
constexpr int64_t kMaxTokens = 4096, kMaxHidden = 16384;
constexpr size_t kMaxElems = static_cast<size_t>(kMaxTokens * kMaxHidden);
constexpr size_t kMaxBytes = kMaxElems * 4;  // fp32: 256 MiB; also the workspace capacity, so every strategy
                                             // runs every grid shape (the default 64 MiB sends the largest to NCCL)
constexpr float kEps = 1e-5f;
constexpr float kFp8Scale = 1.0f / 16.0f;  // quantised values up to ~80: exercises the scale, stays < 448

constexpr FusionPattern kPatterns[] = {FusionPattern::kAllReduce, FusionPattern::kResidualRmsNorm,
                                       FusionPattern::kResidualRmsNormFp8, FusionPattern::kResidualRmsNormOutFp8,
                                       FusionPattern::kRmsNorm};
// The strategy an instance is configured with (one AllReduceFusion each).
struct Variant {
  AllReduceStrategy strategy;
  bool operator<(const Variant& o) const { return strategy < o.strategy; }
};
constexpr Variant kOneShot{AllReduceStrategy::kOneShot};
constexpr Variant kTwoShot{AllReduceStrategy::kTwoShot};
constexpr Variant kNccl{AllReduceStrategy::kNccl};
constexpr Variant kAuto{AllReduceStrategy::kAuto};
constexpr Variant kVariants[] = {kOneShot, kTwoShot, kNccl, kAuto};
// The grid runs every strategy.
constexpr Variant kGridVariants[] = {kOneShot, kTwoShot, kNccl, kAuto};
// The single-strategy tests.
constexpr Variant kSingleVariants[] = {kOneShot, kTwoShot, kNccl};

// Runs fn(begin, end) over [0, n) split across the machine's cores, at least `grain` items a thread (inline
// when n is small: the 10,000-call test must not pay thread start-ups for small shapes).
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 65536) {
  const int64_t threads = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), n / grain + 1);
  if (threads <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back(fn, n * t / threads, n * (t + 1) / threads);
  for (std::thread& th : pool) th.join();
}

// SplitMix64's finaliser of (seed, i): every element of every stream computable alone.
uint64_t mix(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + (i + 1) * 0xd1b54a32d192ed03ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// Element i of stream `seed`: in [-1, -0.05] U [0.05, 1] (never zero, so a lost element cannot pass as 0).
float hash_value(uint64_t seed, uint64_t i) {
  const uint64_t z = mix(seed, i);
  const float u = static_cast<float>(z >> 40) / static_cast<float>(1 << 24);  // [0, 1)
  const float m = 0.05f + 0.95f * u;
  return (z & 1u) ? m : -m;
}

// One host array in `dtype`: the bytes to upload and the same values as fp32 (what the reference uses).
struct HostArray {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
};
void round_to(DType t, HostArray& a) {
  const int64_t n = static_cast<int64_t>(a.values.size());
  a.bytes.resize(static_cast<size_t>(n) * dtype_size(t));
  parallel_for(n, [&](int64_t b, int64_t e) {
    convert_from_f32(a.values.data() + b, t, a.bytes.data() + b * static_cast<int64_t>(dtype_size(t)),
                     static_cast<size_t>(e - b));
    convert_to_f32(a.bytes.data() + b * static_cast<int64_t>(dtype_size(t)), t, a.values.data() + b,
                   static_cast<size_t>(e - b));
  });
}

// Host data of one call: every rank's input, the residual (rank 0's: in the model every rank holds the same
// residual, so both ranks get this one) and the norm weight.
struct CallData {
  DType dtype = DType::kBF16;
  int64_t tokens = 0, hidden = 0;
  HostArray input[kRanks];
  HostArray residual, weight;
  size_t elems() const { return static_cast<size_t>(tokens * hidden); }
  size_t bytes() const { return elems() * dtype_size(dtype); }
};

CallData make_data(DType t, int64_t tokens, int64_t hidden, uint64_t seed) {
  CallData d;
  d.dtype = t;
  d.tokens = tokens;
  d.hidden = hidden;
  const int64_t n = tokens * hidden;
  for (HostArray* a : {&d.input[0], &d.input[1], &d.residual}) a->values.resize(static_cast<size_t>(n));
  parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      d.input[0].values[static_cast<size_t>(i)] = hash_value(seed * 4 + 0, static_cast<uint64_t>(i));
      d.input[1].values[static_cast<size_t>(i)] = hash_value(seed * 4 + 1, static_cast<uint64_t>(i));
      d.residual.values[static_cast<size_t>(i)] = 2.0f * hash_value(seed * 4 + 2, static_cast<uint64_t>(i));
    }
  });
  d.weight.values.resize(static_cast<size_t>(hidden));
  for (int64_t c = 0; c < hidden; ++c) d.weight.values[static_cast<size_t>(c)] = 1.0f + 0.5f * hash_value(seed * 4 + 3, static_cast<uint64_t>(c));
  for (HostArray* a : {&d.input[0], &d.input[1], &d.residual, &d.weight}) round_to(t, *a);
  return d;
}

// The fp32 reference: sum over ranks (rank order), + residual, RMSNorm (sum of squares in double).
struct Reference {
  std::vector<float> sum, residual_out, norm_res, norm_plain;  // norm of residual_out / of the plain sum
};
Reference reference(const CallData& d) {
  const size_t n = d.elems();
  Reference ref;
  for (auto* v : {&ref.sum, &ref.residual_out, &ref.norm_res, &ref.norm_plain}) v->resize(n);
  const float* w = d.weight.values.data();
  auto norm_row = [&](const float* x, float* out) {
    double ss = 0.0;
    for (int64_t c = 0; c < d.hidden; ++c) ss += static_cast<double>(x[c]) * x[c];
    const float rinv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d.hidden) + kEps));
    for (int64_t c = 0; c < d.hidden; ++c) out[c] = x[c] * rinv * w[c];
  };
  parallel_for(d.tokens, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const size_t o = static_cast<size_t>(t * d.hidden);
      for (int64_t c = 0; c < d.hidden; ++c) {
        const size_t i = o + static_cast<size_t>(c);
        ref.sum[i] = 0.0f + d.input[0].values[i] + d.input[1].values[i];
        ref.residual_out[i] = ref.sum[i] + d.residual.values[i];
      }
      norm_row(ref.residual_out.data() + o, ref.norm_res.data() + o);
      norm_row(ref.sum.data() + o, ref.norm_plain.data() + o);
    }
  }, std::max<int64_t>(1, 16384 / d.hidden));
  return ref;
}

// 16-bit storage (bf16 and fp16: fp16 rounds finer, so the bf16 bound covers it) or fp32.
Tolerance tolerance(DType t) { return t == DType::kF32 ? test::kF32Elementwise : test::kBF16Elementwise; }
// The FP8 output is quantised from the same fp32 norm the norm output comes from, so its error is the norm's
// (in the quantised domain: divided by the scale) plus one e4m3 step (the e4m3 step alone is too tight
// where the 16-bit-rounded sum nearly cancels the residual).
Tolerance fp8_tolerance(DType t) {
  const Tolerance tol = tolerance(t);
  return Tolerance{tol.abs / kFp8Scale + test::kF8E4M3Quant.abs, tol.rel + test::kF8E4M3Quant.rel};
}

std::string variant_name(Variant v) { return std::string(strategy_name(v.strategy)); }

std::string case_name(DType t, int64_t hidden, int64_t tokens, Variant v, FusionPattern p) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "%s hidden %lld tokens %lld %s %s", std::string(dtype_name(t)).c_str(),
                static_cast<long long>(hidden), static_cast<long long>(tokens), variant_name(v).c_str(),
                std::string(pattern_name(p)).c_str());
  return buf;
}

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

// What a check found: failures (with a message naming the worst element of each failing output) and the
// largest error / bound ratio seen (how close the passing outputs came to their bound).
struct CheckResult {
  int failures = 0;
  std::string message;
  float worst_ratio = 0.0f;
  std::string worst_output;
};

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

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
    for (Variant v : kVariants) {
      AllReduceConfig c;
      c.strategy = v.strategy;
      c.max_message_bytes = static_cast<int64_t>(kMaxBytes);
      fusion_[v] = new AllReduceFusion(*comm_, *topo_, c);
    }
    for (int r = 0; r < kRanks; ++r) {
      RankBuffers& b = buffers_[r];
      check_cuda(cudaSetDevice(r), "cudaSetDevice");
      for (void** p : {&b.input, &b.residual_in, &b.residual_out, &b.norm_out, &b.output}) {
        check_cuda(cudaMalloc(p, kMaxBytes), "cudaMalloc");
      }
      check_cuda(cudaMalloc(&b.fp8_out, kMaxElems), "cudaMalloc");
      check_cuda(cudaMalloc(&b.weight, static_cast<size_t>(kMaxHidden) * 4), "cudaMalloc");
      check_cuda(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    // GPU 0: the reference, a copy of rank 1's output, the reports.
    check_cuda(cudaSetDevice(0), "cudaSetDevice");
    for (float** p : {&ref_sum_, &ref_residual_out_, &ref_norm_res_, &ref_norm_plain_}) {
      check_cuda(cudaMalloc(p, kMaxBytes), "cudaMalloc");
    }
    check_cuda(cudaMalloc(&peer_copy_, kMaxBytes), "cudaMalloc");
    check_cuda(cudaMalloc(&reports_, sizeof(Reports)), "cudaMalloc");
    check_cuda(cudaStreamCreateWithFlags(&check_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
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
    cudaSetDevice(0);
    for (void* p : {static_cast<void*>(ref_sum_), static_cast<void*>(ref_residual_out_),
                    static_cast<void*>(ref_norm_res_), static_cast<void*>(ref_norm_plain_), peer_copy_,
                    static_cast<void*>(reports_)}) {
      cudaFree(p);
    }
    cudaStreamDestroy(check_stream_);
    delete topo_;
    delete comm_;
    comm_ = nullptr;
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
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

  // Rank r's inputs of d onto its GPU (rank 0 also uploads the reference to GPU 0); on r's thread.
  static void upload(int r, const CallData& d, const Reference* ref) {
    const RankBuffers& b = buffers_[r];
    check_cuda(cudaMemcpy(b.input, d.input[r].bytes.data(), d.bytes(), cudaMemcpyHostToDevice), "upload input");
    check_cuda(cudaMemcpy(b.residual_in, d.residual.bytes.data(), d.bytes(), cudaMemcpyHostToDevice), "upload residual");
    check_cuda(cudaMemcpy(b.weight, d.weight.bytes.data(), d.weight.bytes.size(), cudaMemcpyHostToDevice), "upload weight");
    if (r == 0 && ref) {
      const size_t bytes = d.elems() * 4;
      check_cuda(cudaMemcpy(ref_sum_, ref->sum.data(), bytes, cudaMemcpyHostToDevice), "upload ref");
      check_cuda(cudaMemcpy(ref_residual_out_, ref->residual_out.data(), bytes, cudaMemcpyHostToDevice), "upload ref");
      check_cuda(cudaMemcpy(ref_norm_res_, ref->norm_res.data(), bytes, cudaMemcpyHostToDevice), "upload ref");
      check_cuda(cudaMemcpy(ref_norm_plain_, ref->norm_plain.data(), bytes, cudaMemcpyHostToDevice), "upload ref");
    }
  }
  // Poisons rank r's outputs (not residual_in when the call updates it in place) on its stream.
  static void poison(int r, const CallData& d, bool in_place) {
    const RankBuffers& b = buffers_[r];
    for (void* p : {b.norm_out, b.output}) check_cuda(cudaMemsetAsync(p, 0xff, d.bytes(), b.stream), "poison");
    if (!in_place) check_cuda(cudaMemsetAsync(b.residual_out, 0xff, d.bytes(), b.stream), "poison");
    check_cuda(cudaMemsetAsync(b.fp8_out, 0xff, d.elems(), b.stream), "poison");
  }
  // Uploads d (and ref when given), poisons, runs one call on both ranks (rank `delayed` starts 200 ms late),
  // waits. Returns the strategy rank 0 took.
  static AllReduceStrategy run_call(AllReduceFusion& ar, const CallData& d, const Reference* ref,
                                    FusionPattern pattern, bool in_place = false, int delayed = -1) {
    AllReduceStrategy took[kRanks] = {};
    comm_->run_ranks([&](int r) {
      if (ref || in_place) upload(r, d, ref);
      poison(r, d, in_place);
      if (r == delayed) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      took[r] = ar.run(r, params_for(r, d, pattern, in_place), buffers_[r].stream);
      check_cuda(cudaStreamSynchronize(buffers_[r].stream), "rank stream");
      check_cuda(cudaGetLastError(), "rank stream");
    });
    if (took[0] != took[1]) throw std::runtime_error("ranks took different strategies");
    return took[0];
  }

  struct Reports {
    CloseReport close[3];
    unsigned long long diff[3];
  };
  // Checks what `pattern` wrote on rank 0 against the reference on GPU 0, and rank 1's bytes against rank 0's.
  static CheckResult check(const CallData& d, const Reference& ref, FusionPattern pattern, bool in_place) {
    struct Output {
      const char* name;
      DType dtype;
      void* rank_ptr[kRanks];
      const float* want;  // on GPU 0
      const std::vector<float>* want_host;
      float want_scale;
      Tolerance tol;
    };
    std::vector<Output> outs;
    const Tolerance tol = tolerance(d.dtype);
    auto both = [&](void* RankBuffers::*m) {
      return std::vector<void*>{buffers_[0].*m, buffers_[1].*m};
    };
    auto add = [&](const char* name, DType t, std::vector<void*> p, const float* want, const std::vector<float>& host,
                   float scale, Tolerance tl) { outs.push_back({name, t, {p[0], p[1]}, want, &host, scale, tl}); };
    if (pattern == FusionPattern::kAllReduce) add("output", d.dtype, both(&RankBuffers::output), ref_sum_, ref.sum, 1.0f, tol);
    if (has_residual(pattern)) {
      add("residual_out", d.dtype, both(in_place ? &RankBuffers::residual_in : &RankBuffers::residual_out),
          ref_residual_out_, ref.residual_out, 1.0f, tol);
    }
    if (has_norm_out(pattern)) {
      const bool plain = pattern == FusionPattern::kRmsNorm;
      add("norm_out", d.dtype, both(&RankBuffers::norm_out), plain ? ref_norm_plain_ : ref_norm_res_,
          plain ? ref.norm_plain : ref.norm_res, 1.0f, tol);
    }
    if (has_fp8_out(pattern)) {
      add("fp8_out", DType::kF8E4M3, both(&RankBuffers::fp8_out), ref_norm_res_, ref.norm_res, 1.0f / kFp8Scale,
          fp8_tolerance(d.dtype));
    }
    check_cuda(cudaSetDevice(0), "cudaSetDevice");
    const int64_t n = static_cast<int64_t>(d.elems());
    for (size_t k = 0; k < outs.size(); ++k) {
      const Output& o = outs[k];
      cuda::dist::launch_check_close(o.dtype, o.rank_ptr[0], o.want, o.want_scale, n, o.tol.abs, o.tol.rel,
                                     &reports_->close[k], check_stream_);
      const int64_t bytes = n * static_cast<int64_t>(dtype_size(o.dtype));
      check_cuda(cudaMemcpyPeerAsync(peer_copy_, 0, o.rank_ptr[1], 1, static_cast<size_t>(bytes), check_stream_),
                 "cudaMemcpyPeerAsync");
      cuda::dist::launch_count_diff_words(o.rank_ptr[0], peer_copy_, bytes, &reports_->diff[k], check_stream_);
    }
    Reports host{};
    check_cuda(cudaMemcpyAsync(&host, reports_, sizeof(Reports), cudaMemcpyDeviceToHost, check_stream_), "reports");
    check_cuda(cudaStreamSynchronize(check_stream_), "check stream");
    CheckResult res;
    for (size_t k = 0; k < outs.size(); ++k) {
      const Output& o = outs[k];
      const float ratio = cuda::dist::worst_ratio(host.close[k]);
      if (ratio > res.worst_ratio) {
        res.worst_ratio = ratio;
        res.worst_output = o.name;
      }
      if (host.close[k].bad) {
        const int64_t i = cuda::dist::worst_index(host.close[k]);
        uint8_t raw[4] = {};
        const size_t es = dtype_size(o.dtype);
        check_cuda(cudaMemcpy(raw, static_cast<const uint8_t*>(o.rank_ptr[0]) + static_cast<size_t>(i) * es, es,
                              cudaMemcpyDeviceToHost), "download worst");
        float got = 0.0f;
        convert_to_f32(raw, o.dtype, &got, 1);
        char buf[320];
        std::snprintf(buf, sizeof(buf),
                      "%s: %llu of %lld elements outside |got - want| <= %g + %g |want|; worst at %lld (row %lld, "
                      "column %lld): got %.8g want %.8g\n",
                      o.name, host.close[k].bad, static_cast<long long>(n), o.tol.abs, o.tol.rel,
                      static_cast<long long>(i), static_cast<long long>(i / d.hidden),
                      static_cast<long long>(i % d.hidden), static_cast<double>(got),
                      static_cast<double>((*o.want_host)[static_cast<size_t>(i)] * o.want_scale));
        res.message += buf;
        ++res.failures;
      }
      if (host.diff[k]) {
        res.message += std::string(o.name) + ": ranks 0 and 1 differ in " + std::to_string(host.diff[k]) + " words\n";
        ++res.failures;
      }
    }
    return res;
  }

  static inline std::string skip_;
  static inline Communicator* comm_ = nullptr;
  static inline Topology* topo_ = nullptr;
  static inline std::map<Variant, AllReduceFusion*> fusion_;
  static inline RankBuffers buffers_[kRanks];
  static inline float *ref_sum_ = nullptr, *ref_residual_out_ = nullptr, *ref_norm_res_ = nullptr,
                      *ref_norm_plain_ = nullptr;
  static inline void* peer_copy_ = nullptr;
  static inline Reports* reports_ = nullptr;
  static inline cudaStream_t check_stream_ = nullptr;
};

TEST_F(AllReduceTwoGpu, EveryPatternDtypeHiddenTokensAndStrategy) {
  struct Summary {
    int cases = 0, failed = 0;
    float worst_ratio = 0.0f;
    std::string worst_case;
  };
  std::map<FusionPattern, Summary> summary;
  int reported = 0;
  uint64_t seed = 1;
  const auto t0 = std::chrono::steady_clock::now();
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (int64_t hidden : {128, 2688, 4096, 4480, 8192, 16384}) {
      for (int64_t tokens : {1, 2, 7, 64, 128, 129, 1000, 4096}) {
        const CallData d = make_data(t, tokens, hidden, seed++);
        const Reference ref = reference(d);
        comm_->run_ranks([&](int r) { upload(r, d, &ref); });
        for (Variant v : kGridVariants) {
          for (FusionPattern pattern : kPatterns) {
            const std::string name = case_name(t, hidden, tokens, v, pattern);
            const AllReduceStrategy took = run_call(*fusion_[v], d, nullptr, pattern);
            // Every grid shape fits the 256 MiB workspace, so a forced strategy runs as asked.
            if (v.strategy != AllReduceStrategy::kAuto) { EXPECT_EQ(took, v.strategy) << name; }
            const CheckResult c = check(d, ref, pattern, false);
            Summary& sum = summary[pattern];
            ++sum.cases;
            if (c.worst_ratio > sum.worst_ratio) {
              sum.worst_ratio = c.worst_ratio;
              sum.worst_case = name + " " + c.worst_output;
            }
            if (c.failures) {
              ++sum.failed;
              if (++reported <= 20) ADD_FAILURE() << name << " (took " << strategy_name(took) << "):\n" << c.message;
            }
          }
        }
      }
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (FusionPattern p : kPatterns) {
    const Summary& s = summary[p];
    std::printf("allreduce grid: pattern %-24s %d cases (3 dtypes x 6 hidden x 8 tokens x 5 variants), %d failed; "
                "largest error/bound %.3g (%s)\n",
                std::string(pattern_name(p)).c_str(), s.cases, s.failed, static_cast<double>(s.worst_ratio),
                s.worst_case.c_str());
  }
  std::printf("allreduce grid: %.1f s\n", secs);
}

TEST_F(AllReduceTwoGpu, TenThousandConsecutiveCallsEachChecked) {
  // Fresh data every call; the shape, dtype, pattern, in-place residual and strategy change from call to call
  // (a pseudo-random walk, so no two neighbours repeat a pattern the kernels could get right by accident). The
  // AUTO instances alternate ONESHOT and TWOSHOT in one workspace (where the table says so);
  // every Lamport slot is cleared after calls of other extents and other dtypes.
  const int64_t hiddens[] = {128, 256, 1024, 2688, 4096};
  const int64_t tokens_list[] = {1, 2, 3, 7, 16, 64, 129, 160};
  const DType dtypes[] = {DType::kBF16, DType::kF16, DType::kF32};
  std::map<AllReduceStrategy, int> calls;
  int failures = 0;
  for (int call = 0; call < 10000; ++call) {
    const uint64_t h = mix(7, static_cast<uint64_t>(call));
    const Variant s = kVariants[call % std::size(kVariants)];  // every variant 2,500 times, interleaved
    const FusionPattern pattern = kPatterns[(h >> 3) % 5];
    const DType t = dtypes[(h >> 7) % 3];
    const int64_t hidden = hiddens[(h >> 11) % 5];
    const int64_t tokens = tokens_list[(h >> 15) % 8];
    const bool in_place = has_residual(pattern) && ((h >> 19) & 1);
    const CallData d = make_data(t, tokens, hidden, 100000 + static_cast<uint64_t>(call));
    const Reference ref = reference(d);
    const AllReduceStrategy took = run_call(*fusion_[s], d, &ref, pattern, in_place);
    ++calls[took];
    const CheckResult c = check(d, ref, pattern, in_place);
    if (c.failures && ++failures <= 10) {
      ADD_FAILURE() << "call " << call << ": " << case_name(t, hidden, tokens, s, pattern)
                    << (in_place ? " in place" : "") << " (took " << strategy_name(took) << "):\n"
                    << c.message;
    }
  }
  std::printf("10000 calls: %d oneshot, %d twoshot, %d nccl; %d failed\n", calls[AllReduceStrategy::kOneShot],
              calls[AllReduceStrategy::kTwoShot], calls[AllReduceStrategy::kNccl], failures);
  EXPECT_EQ(failures, 0);
}

TEST_F(AllReduceTwoGpu, NegativeZeroAndNanInputs) {
  for (Variant s : kSingleVariants) {
    for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
      CallData d = make_data(t, 7, 2688, 77);
      // Row 1 all -0.0 on both ranks (a reader that took -0.0 for "not arrived" would hang here); scattered
      // -0.0 in row 2; one NaN in row 4 of rank 0 (its norm row is all NaN, as in the reference).
      for (int r = 0; r < kRanks; ++r) {
        auto& in = d.input[r].values;
        for (int64_t c = 0; c < d.hidden; ++c) in[static_cast<size_t>(d.hidden + c)] = -0.0f;
        for (int64_t c = 0; c < d.hidden; c += 3) in[static_cast<size_t>(2 * d.hidden + c)] = -0.0f;
      }
      d.input[0].values[static_cast<size_t>(4 * d.hidden + 5)] = std::nanf("");
      if (t == DType::kF32) d.input[1].values[10] = f32_from_bits(0x80008000u);  // the fp32 empty pattern itself
      for (HostArray& a : d.input) round_to(t, a);
      const Reference ref = reference(d);
      for (FusionPattern pattern : {FusionPattern::kAllReduce, FusionPattern::kResidualRmsNorm}) {
        run_call(*fusion_[s], d, &ref, pattern);
        const CheckResult got = check(d, ref, pattern, false);
        EXPECT_EQ(got.failures, 0) << variant_name(s) << " " << dtype_name(t) << " " << pattern_name(pattern) << ":\n"
                                   << got.message;
      }
    }
  }
}

TEST_F(AllReduceTwoGpu, OneRankDelayed) {
  for (Variant s : kSingleVariants) {
    for (int delayed = 0; delayed < kRanks; ++delayed) {
      const CallData d = make_data(DType::kBF16, 64, 8192, 5 + static_cast<uint64_t>(delayed));
      const Reference ref = reference(d);
      run_call(*fusion_[s], d, &ref, FusionPattern::kResidualRmsNorm, false, delayed);
      const CheckResult c = check(d, ref, FusionPattern::kResidualRmsNorm, false);
      EXPECT_EQ(c.failures, 0) << variant_name(s) << " rank " << delayed << " late:\n" << c.message;
    }
  }
}

TEST_F(AllReduceTwoGpu, GraphCaptureAndThousandReplays) {
  // The captured call reads the same buffers every replay; fresh data is uploaded between replays, and the
  // device-side Lamport slot / barrier epochs must advance inside the graph for every replay to be right.
  for (Variant s : {kOneShot, kTwoShot}) {
    const FusionPattern pattern = FusionPattern::kResidualRmsNormOutFp8;
    CallData d = make_data(DType::kBF16, 32, 4096, 300);
    cudaGraphExec_t exec[kRanks] = {};
    comm_->run_ranks([&](int r) {
      cudaStream_t st = buffers_[r].stream;
      cudaGraph_t graph = nullptr;
      check_cuda(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
      fusion_[s]->run(r, params_for(r, d, pattern, false), st);
      check_cuda(cudaStreamEndCapture(st, &graph), "end capture");
      check_cuda(cudaGraphInstantiate(&exec[r], graph, 0), "instantiate");
      cudaGraphDestroy(graph);
    });
    int failures = 0;
    for (int replay = 0; replay < 1000; ++replay) {
      d = make_data(DType::kBF16, 32, 4096, 400 + static_cast<uint64_t>(replay));
      const Reference ref = reference(d);
      comm_->run_ranks([&](int r) {
        upload(r, d, &ref);
        poison(r, d, false);
        check_cuda(cudaGraphLaunch(exec[r], buffers_[r].stream), "graph launch");
        check_cuda(cudaStreamSynchronize(buffers_[r].stream), "graph replay");
      });
      const CheckResult c = check(d, ref, pattern, false);
      if (c.failures && ++failures <= 5) ADD_FAILURE() << variant_name(s) << " replay " << replay << ":\n" << c.message;
    }
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(r);
      cudaGraphExecDestroy(exec[r]);
    }
    EXPECT_EQ(failures, 0) << variant_name(s);
  }
}

TEST_F(AllReduceTwoGpu, BackToBackCallsWithoutHostSync) {
  // 200 calls enqueued on each rank's stream with no host sync in between, so consecutive AllReduce kernels can
  // overlap under PDL (run_call synchronises after every call, so only this test sees that). The token count
  // changes from call to call (the ONESHOT blocks' clear extents must follow); the last call takes every row.
  // Each call updates the residual in place, so an error in any call reaches the final residual_out, which is
  // checked against a host replay of the chain (same fp32 order as the kernels, rounded to the dtype per call).
  // Call j reads input set j % kSets (different values at the same addresses): a kernel that read a peer's data
  // of the previous call (a staging / Lamport buffer reused too early) would add the wrong set's values.
  //
  // The replay rounds like the strategy that ran each call: ONESHOT adds the fp32 sum to the residual and rounds
  // once; TWOSHOT (its all-gather moves dtype values) and NCCL (its output is in the dtype) round the sum to the
  // dtype first. One call's double rounding stays within the tolerance, but the in-place chain amplifies it: once
  // the bf16 residual's step (0.5 from 64) is about the sum, a sum near a tie (0.748 -> 0.75) adds 0.5 per call
  // single-rounded and 0.5 or 1 (ties to even) double-rounded, so a replay that rounded once for TWOSHOT would
  // drift far outside the bound.
  constexpr int kCalls = 200, kSets = 3;
  constexpr int64_t kHidden = 2688, kRows = 160;
  const int64_t tokens_list[] = {1, 7, 64, 129, 160, 2, 33};
  for (bool pdl : {true, false}) {
    for (Variant v : {kOneShot, kAuto, kTwoShot}) {
      for (DType t : {DType::kBF16, DType::kF32}) {
        const std::string name = variant_name(v) + " " + std::string(dtype_name(t)) + (pdl ? " pdl" : " no pdl");
        const uint64_t seed = 5000 + static_cast<uint64_t>(v.strategy) * 16 +
                              (pdl ? 2 : 0) + (t == DType::kF32 ? 1 : 0);
        // Set 0 also gives the starting residual and the norm weight.
        std::vector<CallData> sets;
        for (int k = 0; k < kSets; ++k) sets.push_back(make_data(t, kRows, kHidden, seed + 1000 * static_cast<uint64_t>(k)));
        const CallData& d = sets[0];
        std::vector<int64_t> tokens(kCalls);
        for (int j = 0; j < kCalls; ++j) tokens[static_cast<size_t>(j)] = tokens_list[mix(11, static_cast<uint64_t>(j)) % 7];
        tokens.back() = kRows;
        // Host replay of calls 0 .. kCalls - 2 on their first tokens[j] rows:
        //   ONESHOT:        residual <- round((0 + in0) + in1 + residual)
        //   TWOSHOT, NCCL:  residual <- round(round((0 + in0) + in1) + residual)
        HostArray chain = d.residual, sum;
        for (int j = 0; j + 1 < kCalls; ++j) {
          const CallData& s = sets[static_cast<size_t>(j % kSets)];
          AllReduceParams q = params_for(0, d, FusionPattern::kResidualRmsNorm, true);
          q.tokens = tokens[static_cast<size_t>(j)];
          const AllReduceStrategy took = fusion_[v]->choose(q);
          const size_t n = static_cast<size_t>(q.tokens * kHidden);
          sum.values.resize(n);
          for (size_t i = 0; i < n; ++i) sum.values[i] = (0.0f + s.input[0].values[i]) + s.input[1].values[i];
          if (took != AllReduceStrategy::kOneShot) round_to(t, sum);
          for (size_t i = 0; i < n; ++i) chain.values[i] = sum.values[i] + chain.values[i];
          round_to(t, chain);
        }
        CallData last = sets[static_cast<size_t>((kCalls - 1) % kSets)];
        last.residual = chain;  // the residual the last call sees
        last.weight = d.weight;
        const Reference ref = reference(last);
        comm_->run_ranks([&](int r) {
          const device::LaunchScope launch_scope(pdl);  // each rank's thread launches with this PDL setting
          upload(r, last, &ref);
          // every set's input side by side in the input buffer; the chain starts from d's residual
          for (int k = 0; k < kSets; ++k) {
            check_cuda(cudaMemcpy(static_cast<char*>(buffers_[r].input) + static_cast<size_t>(k) * d.bytes(),
                                  sets[static_cast<size_t>(k)].input[r].bytes.data(), d.bytes(), cudaMemcpyHostToDevice),
                       "upload input set");
          }
          check_cuda(cudaMemcpy(buffers_[r].residual_in, d.residual.bytes.data(), d.bytes(), cudaMemcpyHostToDevice),
                     "upload residual");
          poison(r, d, true);
          for (int j = 0; j < kCalls; ++j) {
            AllReduceParams p = params_for(r, d, FusionPattern::kResidualRmsNorm, true);
            p.tokens = tokens[static_cast<size_t>(j)];
            p.input = static_cast<const char*>(buffers_[r].input) + static_cast<size_t>(j % kSets) * d.bytes();
            fusion_[v]->run(r, p, buffers_[r].stream);
          }
          check_cuda(cudaStreamSynchronize(buffers_[r].stream), "rank stream");
          check_cuda(cudaGetLastError(), "rank stream");
        });
        const CheckResult c = check(last, ref, FusionPattern::kResidualRmsNorm, true);
        EXPECT_EQ(c.failures, 0) << name << ":\n" << c.message;
      }
    }
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
      EXPECT_EQ(run_call(small, d, &ref, pattern, in_place), AllReduceStrategy::kNccl);
      const CheckResult r = check(d, ref, pattern, in_place);
      EXPECT_EQ(r.failures, 0) << pattern_name(pattern) << (in_place ? " in place" : "") << ":\n" << r.message;
    }
  }
  const CallData fits = make_data(DType::kBF16, 7, 8192, 10);
  const Reference fits_ref = reference(fits);
  EXPECT_EQ(run_call(small, fits, &fits_ref, FusionPattern::kResidualRmsNorm), AllReduceStrategy::kOneShot);
  EXPECT_EQ(check(fits, fits_ref, FusionPattern::kResidualRmsNorm, false).failures, 0);
}

}  // namespace
}  // namespace chimera::dist

#else

TEST(AllReduceTwoGpu, Skipped) { GTEST_SKIP() << "built without CUDA + NCCL"; }

#endif
