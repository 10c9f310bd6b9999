// The ops on LinearWeight / ExpertWeights (ops/quant_ops.h) on the CPU: each quantized op equals its definition
// (dequantize exactly, fake-quantize the activation for FP8 kStatic, then the dense arithmetic) computed here in
// double, within fp32's summation bound; the unfused residual step equals the dense ops; bad weights are named.
#include "ops/quant_ops.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/fp8.h"
#include "core/nvfp4.h"
#include "ops/ops.h"

namespace chimera {
namespace {

using ops::ActQuant;
using ops::WeightFormat;

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

Tensor bytes(DType t, Shape shape, const std::vector<uint8_t>& b) {
  Tensor r = Tensor::empty(t, std::move(shape));
  std::memcpy(r.data(), b.data(), b.size());
  return r;
}

// A quantized [N, K] weight and its exact dequantization.
struct Quantized {
  ops::LinearWeight w;
  std::vector<float> deq;
};
Quantized make(WeightFormat f, int64_t N, int64_t K, uint32_t seed, ActQuant act = ActQuant::kNone,
               float input_scale = 0.0f) {
  const std::vector<float> v = randn(static_cast<size_t>(N * K), seed, 0.1f);
  Quantized q;
  q.w.format = f;
  q.w.act = act;
  q.w.name = "test.proj";
  q.w.input_scale = input_scale;
  q.deq.resize(v.size());
  if (f == WeightFormat::kFp8) {
    const Fp8Weight r = quantize_fp8_per_tensor(v);
    q.w.weight = bytes(DType::kF8E4M3, {N, K}, r.data);
    q.w.scale = r.weight_scale;
    dequantize_fp8(r.data, r.weight_scale, q.deq);
  } else {
    const Nvfp4Weight r = quantize_nvfp4(v, N, K);
    q.w.weight = bytes(DType::kU8, {N, K / 2}, r.packed);
    q.w.weight_scale = bytes(DType::kF8E4M3, {N, K / 16}, r.block_scale);
    q.w.scale = r.weight_scale_2;
    q.deq = dequantize_nvfp4(r);
  }
  return q;
}

// want = x @ deq^T in double; bound = 2 (K + 1) 2^-24 sum |x w| per element.
void expect_product(const Tensor& got, const std::vector<float>& x, const std::vector<float>& w, int64_t T, int64_t K,
                    int64_t N) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      double s = 0.0, a = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        s += static_cast<double>(x[t * K + k]) * w[n * K + k];
        a += std::fabs(static_cast<double>(x[t * K + k]) * w[n * K + k]);
      }
      ASSERT_NEAR(got.f32()[t * N + n], s, 2.0 * (K + 1) * std::ldexp(1.0, -24) * a + 1e-30) << t << ", " << n;
    }
  }
}

TEST(QuantOps, LinearWeightFormatsOnAwkwardSizes) {
  const ops::Context ctx;
  for (const WeightFormat f : {WeightFormat::kFp8, WeightFormat::kNvfp4}) {
    for (const auto& [T, K, N] : {std::tuple<int64_t, int64_t, int64_t>{1, 16, 1}, {3, 48, 7}, {17, 80, 33}}) {
      SCOPED_TRACE(testing::Message() << ops::weight_format_name(f) << " T " << T << " K " << K << " N " << N);
      std::vector<float> x = randn(static_cast<size_t>(T * K), 7);
      const Tensor xt = Tensor::from_f32({T, K}, x);
      Tensor out = Tensor::empty(DType::kF32, {T, N});
      // Weight-only.
      const Quantized q = make(f, N, K, 11);
      ops::linear(ctx, out, xt, q.w);
      expect_product(out, x, q.deq, T, K, N);
      if (f != WeightFormat::kFp8) continue;
      // W8A8 static: x fake-quantized with input_scale first.
      const Quantized s = make(f, N, K, 11, ActQuant::kStatic, 0.01f);
      ops::linear(ctx, out, xt, s.w);
      fake_quantize_fp8(x, 0.01f);
      expect_product(out, x, s.deq, T, K, N);
    }
  }
}

TEST(QuantOps, DenseLinearWeightIsTheDenseOp) {
  const ops::Context ctx;
  const std::vector<float> x = randn(5 * 24, 1), w = randn(9 * 24, 2);
  ops::LinearWeight lw;
  lw.weight = Tensor::from_f32({9, 24}, w);
  const Tensor xt = Tensor::from_f32({5, 24}, x);
  Tensor a = Tensor::empty(DType::kF32, {5, 9}), b = Tensor::empty(DType::kF32, {5, 9});
  ops::linear(ctx, a, xt, lw);
  ops::linear(ctx, b, xt, lw.weight);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
}

TEST(QuantOps, ResidualNormLinearUnfusedEqualsTheDenseSteps) {
  const ops::Context ctx;
  const int64_t T = 4, D = 32, N = 20;
  const Quantized q = make(WeightFormat::kFp8, N, D, 3, ActQuant::kStatic, 0.02f);
  const Tensor residual = Tensor::from_f32({T, D}, randn(T * D, 4)), a = Tensor::from_f32({T, D}, randn(T * D, 5));
  const Tensor norm = Tensor::from_f32({D}, randn(D, 6));
  ops::ResidualNorm rn{residual, Tensor::empty(DType::kF32, {T, D}), a, Tensor(), norm, 1e-5f,
                       Tensor::empty(DType::kF32, {T, D})};
  Tensor out = Tensor::empty(DType::kF32, {T, N});
  const ops::LinearWeight* ws[] = {&q.w};
  ops::residual_norm_linear(ctx, rn, {&out, 1}, ws);
  // The same steps by hand.
  Tensor r2 = residual.clone(), x2 = Tensor::empty(DType::kF32, {T, D}), out2 = Tensor::empty(DType::kF32, {T, N});
  ops::add_rms_norm(ctx, r2, x2, a, norm, 1e-5f);
  ops::linear(ctx, out2, x2, q.w);
  EXPECT_EQ(std::memcmp(rn.residual_out.data(), r2.data(), r2.nbytes()), 0);
  EXPECT_EQ(std::memcmp(out.data(), out2.data(), out.nbytes()), 0);
}

// Routed experts with quantized projections: out[t] = sum_j w[t, j] down_e(relu(up_e(x_t))^2), each expert's
// linear layers as ops::linear on ExpertWeights::expert(e) (FP8 kStatic: each expert's own input scales).
TEST(QuantOps, MoeExpertsEqualThePerTokenLoop) {
  const ops::Context ctx;
  for (const WeightFormat f : {WeightFormat::kFp8, WeightFormat::kNvfp4}) {
    SCOPED_TRACE(ops::weight_format_name(f));
    const int64_t E = 5, I = 32, Din = 48, T = 6, k = 2;
    const ActQuant act = f == WeightFormat::kFp8 ? ActQuant::kStatic : ActQuant::kNone;
    auto build = [&](int64_t N, int64_t K, uint32_t seed) {
      ops::ExpertWeights x;
      x.format = f;
      x.act = act;
      x.name = "test.experts.{e}";
      std::vector<Tensor> w, s;
      for (int64_t e = 0; e < E; ++e) {
        const Quantized q = make(f, N, K, seed + static_cast<uint32_t>(e), act, 0.01f * static_cast<float>(e + 1));
        w.push_back(q.w.weight);
        if (q.w.weight_scale) s.push_back(q.w.weight_scale);
        x.host_scale.push_back(q.w.scale);
        if (act == ActQuant::kStatic) x.host_input_scale.push_back(q.w.input_scale);
      }
      Shape ws = w[0].shape();
      ws.insert(ws.begin(), E);
      x.weight = Tensor::empty(w[0].dtype(), ws);
      for (int64_t e = 0; e < E; ++e) {
        std::memcpy(static_cast<char*>(x.weight.data()) + e * w[0].nbytes(), w[e].data(), w[0].nbytes());
      }
      if (!s.empty()) {
        Shape ss = s[0].shape();
        ss.insert(ss.begin(), E);
        x.weight_scale = Tensor::empty(DType::kF8E4M3, ss);
        for (int64_t e = 0; e < E; ++e) {
          std::memcpy(static_cast<char*>(x.weight_scale.data()) + e * s[0].nbytes(), s[e].data(), s[0].nbytes());
        }
      }
      x.scale = Tensor::from_f32({E}, x.host_scale);
      if (!x.host_input_scale.empty()) x.input_scale = Tensor::from_f32({E}, x.host_input_scale);
      return x;
    };
    const ops::ExpertWeights up = build(I, Din, 100), down = build(Din, I, 200);
    const Tensor x = Tensor::from_f32({T, Din}, randn(T * Din, 9));
    const std::vector<int32_t> ids_v = {0, 3, 4, 1, 2, 0, 3, 4, 1, 0, 4, 2};
    const Tensor ids = Tensor::from_i32({T, k}, ids_v);
    const Tensor wts = Tensor::from_f32({T, k}, randn(T * k, 10));
    Tensor out = Tensor::empty(DType::kF32, {T, Din});
    ops::moe_experts(ctx, out, x, ids, wts, up, down);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> want(static_cast<size_t>(Din), 0.0);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = ids_v[static_cast<size_t>(t * k + j)];
        Tensor h = Tensor::empty(DType::kF32, {1, I}), y = Tensor::empty(DType::kF32, {1, Din});
        ops::linear(ctx, h, x.rows(t, t + 1), up.expert(e));
        ops::relu2(ctx, h);
        ops::linear(ctx, y, h, down.expert(e));
        for (int64_t c = 0; c < Din; ++c) want[c] += static_cast<double>(wts.f32()[t * k + j]) * y.f32()[c];
      }
      for (int64_t c = 0; c < Din; ++c) {
        ASSERT_NEAR(out.f32()[t * Din + c], want[c], 1e-5 * (1.0 + std::fabs(want[c]))) << t << ", " << c;
      }
    }
  }
}

TEST(QuantOps, BadWeightsAreNamed) {
  const ops::Context ctx;
  auto message = [&](const ops::LinearWeight& w) {
    try {
      ops::validate(w);
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), 2);
      return std::string(e.what());
    }
    return std::string();
  };
  Quantized q = make(WeightFormat::kNvfp4, 8, 32, 1);
  q.w.act = ActQuant::kStatic;
  EXPECT_NE(message(q.w).find("test.proj"), std::string::npos);
  q = make(WeightFormat::kNvfp4, 8, 32, 1);
  q.w.weight_scale = Tensor::zeros(DType::kF8E4M3, {8, 3});
  EXPECT_NE(message(q.w).find("test.proj.weight_scale"), std::string::npos) << message(q.w);
  q = make(WeightFormat::kNvfp4, 8, 32, 1);
  q.w.weight = Tensor::zeros(DType::kU8, {8, 12});  // K = 24: not a multiple of 16
  q.w.weight_scale = Tensor::zeros(DType::kF8E4M3, {8, 1});
  EXPECT_NE(message(q.w).find("multiple of 16"), std::string::npos) << message(q.w);
  q = make(WeightFormat::kFp8, 8, 32, 1, ActQuant::kStatic, 0.0f);
  EXPECT_NE(message(q.w).find("test.proj.input_scale"), std::string::npos) << message(q.w);
}

}  // namespace
}  // namespace chimera
