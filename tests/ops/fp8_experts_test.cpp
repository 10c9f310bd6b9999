// Routed MoE experts with FP8 expert weights: the CPU reference (backends/cpu/fp8_experts.cpp) and the CUDA kernels
// (backends/cuda/moe/fp8_experts.h) against a naive double-precision loop written here from the semantics, and
// CUDA against the CPU reference.
//
// Tolerances. The naive loop computes h exactly (double) and carries, per element, an interval [lo, hi] that holds
// every value a kernel may produce for r = relu(h)^2 after its rounding points (the activation dtype, then the e4m3
// quantization with down's input scale): both are monotone, so rounding the interval's ends bounds them. The
// interval's width before rounding is the accumulation error of h: kAccRandom * sqrt(K) * 2^-24 * sum_k |a_k w_k|
// for fp32 accumulation in any order (a random-walk bound of K roundings, with a factor 4 of margin), and
// 2^-11 * sum_k |a_k w_k| for the FP8 tensor cores (wgmma accumulates FP8 products with about 14 mantissa bits,
// truncating, over the up to four wgmmas between CUTLASS's promotions into fp32 registers: 4 x 2^-13). Where the
// interval straddles an e4m3 (or bf16) rounding boundary, the codes a kernel picks may differ from the naive ones by
// one step: the out tolerance adds |W_down| x (hi - lo) of every such element, plus the down accumulation's own error,
// plus half an ulp of the output dtype. No element is excused: every element of out must lie within its own derived
// bound.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "backends/cpu/fp8_experts.h"
#include "backends/device_api.h"
#include "common/backend_param.h"
#include "common/compare.h"
#include "core/fp8.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/moe/fp8_experts.h"
#endif

namespace chimera {
namespace {

constexpr double kAccRandom = 4.0;

// Expert weights quantized as ModelOpt does (per expert: weight_scale = amax / 448), their exact dequantized
// values, and input scales calibrated on the test's own inputs (amax / 448) times a per-expert factor in
// [0.3, 1.3], so some experts saturate.
struct Fp8Experts {
  ops::ExpertWeights up, down;      // host
  std::vector<float> up_w, down_w;  // dequantized [E, N, K]
};

ops::ExpertWeights make_weights(test::Rng& rng, int64_t E, int64_t N, int64_t K, ops::ActQuant act, const char* name,
                                std::vector<float>& deq) {
  ops::ExpertWeights w;
  w.format = ops::WeightFormat::kFp8;
  w.act = act;
  w.name = name;
  w.weight = Tensor::empty(DType::kF8E4M3, {E, N, K});
  deq.resize(static_cast<size_t>(E * N * K));
  auto* bytes = static_cast<uint8_t*>(w.weight.data());
  for (int64_t e = 0; e < E; ++e) {
    std::vector<float> v(static_cast<size_t>(N * K));
    const float sd = rng.uniform(0.02f, 0.2f) / std::sqrt(static_cast<float>(K)) * 8.0f;
    for (float& f : v) f = rng.normal(0.0f, sd);
    const Fp8Weight q = quantize_fp8_per_tensor(v);
    std::memcpy(bytes + e * N * K, q.data.data(), q.data.size());
    w.host_scale.push_back(q.weight_scale);
    dequantize_fp8(q.data, q.weight_scale, std::span<float>(deq.data() + e * N * K, static_cast<size_t>(N * K)));
  }
  w.scale = Tensor::from_f32({E}, w.host_scale);
  return w;
}

void set_input_scales(test::Rng& rng, ops::ExpertWeights& w, const std::vector<float>& amax) {
  if (w.act != ops::ActQuant::kStatic) return;
  w.host_input_scale.clear();
  for (float a : amax) w.host_input_scale.push_back(std::max(a, 1e-3f) / kE4m3Max * rng.uniform(0.3f, 1.3f));
  w.input_scale = Tensor::from_f32({static_cast<int64_t>(amax.size())}, w.host_input_scale);
}

// Routing: k distinct experts per token, drawn from [0, E) minus `skip` (an expert nobody picks; -1: none),
// weights in [0.1, 1).
void make_routing(test::Rng& rng, int64_t T, int64_t E, int64_t k, int64_t skip, Tensor& ids, Tensor& w) {
  ids = Tensor::empty(DType::kI32, {T, k});
  w = Tensor::empty(DType::kF32, {T, k});
  std::vector<int32_t> pool;
  for (int64_t e = 0; e < E; ++e) {
    if (e != skip) pool.push_back(static_cast<int32_t>(e));
  }
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(pool.begin(), pool.end(), rng.engine());
    for (int64_t j = 0; j < k; ++j) {
      ids.i32()[t * k + j] = pool[static_cast<size_t>(j)];
      w.f32()[t * k + j] = rng.uniform(0.1f, 1.0f);
    }
  }
}

float round_act(float v, DType act) {
  if (act == DType::kF32) return v;
  uint16_t h = 0;
  convert_from_f32(&v, act, &h, 1);
  float r = 0.0f;
  convert_to_f32(&h, act, &r, 1);
  return r;
}
float fake_q(float v, float in) {
  return e4m3_to_f32(f32_to_e4m3(v / in)) * in;
}

struct Reference {
  std::vector<float> out, tol;
};

// x: values representable in `act`. acc_rel(K): the accumulation error of one dot product per unit of sum |terms|.
// Two passes: every routed row's r first (its value and interval after the activation dtype's rounding), then the
// down projections, so that a dynamic down scale can be taken over every r. A dynamic scale is itself an interval
// [s_lo, s_hi] = [max r_lo, max r_hi] / 448 (a kernel's r lies in its interval, so its max does), and a quantized r
// lies in [e4m3(r_lo / s_hi) * s_lo, e4m3(r_hi / s_lo) * s_hi] (rounding and positive scaling are monotone).
template <typename AccRel>
Reference naive(const Tensor& x, const Tensor& ids, const Tensor& w, const Fp8Experts& s, DType act, AccRel acc_rel) {
  const int64_t T = x.dim(0), D = x.dim(1), k = ids.dim(1), I = s.up.out_features();
  const ops::ActQuant up_act = s.up.act, down_act = s.down.act;
  std::vector<double> out(static_cast<size_t>(T * D), 0.0), tol(static_cast<size_t>(T * D), 0.0),
      mag(static_cast<size_t>(T * D), 0.0);
  std::vector<float> a(static_cast<size_t>(D));
  const double up_rel = acc_rel(D), down_rel = acc_rel(I);
  // up's dynamic scale is exact: x is given, and max / 448 is computed the same way everywhere.
  float s_x = 1.0f;
  if (up_act == ops::ActQuant::kDynamic) {
    float m = 0.0f;
    for (int64_t i = 0; i < x.numel(); ++i) m = std::max(m, std::fabs(x.f32()[i]));
    s_x = m > 0.0f ? m / kE4m3Max : 1.0f;
  }
  const int64_t P = T * k;
  std::vector<float> r_mid(static_cast<size_t>(P * I)), r_lo(r_mid.size()), r_hi(r_mid.size());
  for (int64_t p = 0; p < P; ++p) {
    const int64_t t = p / k, e = ids.i32()[p];
    const size_t ue = static_cast<size_t>(e);
    for (int64_t c = 0; c < D; ++c) {
      const float xv = x.f32()[t * D + c];
      a[c] = up_act == ops::ActQuant::kStatic    ? fake_q(xv, s.up.host_input_scale[ue])
             : up_act == ops::ActQuant::kDynamic ? fake_q(xv, s_x)
                                                 : xv;
    }
    const float* wu = s.up_w.data() + e * I * D;
    for (int64_t i = 0; i < I; ++i) {
      double h = 0.0, sum_abs = 0.0;
      for (int64_t c = 0; c < D; ++c) {
        h += static_cast<double>(a[c]) * wu[i * D + c];
        sum_abs += std::fabs(static_cast<double>(a[c]) * wu[i * D + c]);
      }
      const double err = up_rel * sum_abs + std::fabs(h) * 0x1p-22;
      auto r_of = [&](double hv) {
        const double r = std::max(hv, 0.0);
        return round_act(static_cast<float>(r * r), act);
      };
      // The interval's ends, widened by one fp32 ulp for the conversion of r*r itself.
      const double lo = std::max(h - err, 0.0), hi = std::max(h + err, 0.0);
      const size_t o = static_cast<size_t>(p * I + i);
      r_mid[o] = r_of(h);
      r_lo[o] = r_of(lo * (1.0 - 0x1p-23));
      r_hi[o] = r_of(hi * (1.0 + 0x1p-23));
    }
  }
  float sd_mid = 1.0f, sd_lo = 1.0f, sd_hi = 1.0f;
  if (down_act == ops::ActQuant::kDynamic) {
    float m_mid = 0.0f, m_lo = 0.0f, m_hi = 0.0f;
    for (size_t o = 0; o < r_mid.size(); ++o) {
      m_mid = std::max(m_mid, r_mid[o]);
      m_lo = std::max(m_lo, r_lo[o]);
      m_hi = std::max(m_hi, r_hi[o]);
    }
    EXPECT_GT(m_lo, 0.0f) << "a test case whose r may all be zero";
    sd_mid = m_mid / kE4m3Max;
    sd_lo = m_lo / kE4m3Max;
    sd_hi = m_hi / kE4m3Max;
  }
  std::vector<float> v(static_cast<size_t>(I)), width(static_cast<size_t>(I));
  for (int64_t p = 0; p < P; ++p) {
    const int64_t t = p / k, e = ids.i32()[p];
    const size_t ue = static_cast<size_t>(e);
    const double wt = w.f32()[p];
    for (int64_t i = 0; i < I; ++i) {
      const size_t o = static_cast<size_t>(p * I + i);
      float lo = r_lo[o], hi = r_hi[o];
      v[i] = r_mid[o];
      if (down_act == ops::ActQuant::kStatic) {
        const float in = s.down.host_input_scale[ue];
        v[i] = fake_q(v[i], in);
        lo = fake_q(lo, in);
        hi = fake_q(hi, in);
      } else if (down_act == ops::ActQuant::kDynamic) {
        v[i] = fake_q(v[i], sd_mid);
        lo = e4m3_to_f32(f32_to_e4m3(lo / sd_hi)) * sd_lo;
        hi = e4m3_to_f32(f32_to_e4m3(hi / sd_lo)) * sd_hi;
      }
      width[i] = hi - lo;
    }
    const float* wd = s.down_w.data() + e * D * I;
    for (int64_t n = 0; n < D; ++n) {
      double y = 0.0, sum_abs = 0.0, allow = 0.0;
      for (int64_t i = 0; i < I; ++i) {
        y += static_cast<double>(v[i]) * wd[n * I + i];
        sum_abs += std::fabs(static_cast<double>(v[i]) * wd[n * I + i]);
        allow += std::fabs(static_cast<double>(wd[n * I + i])) * width[i];
      }
      const size_t o = static_cast<size_t>(t * D + n);
      out[o] += wt * y;
      mag[o] += wt * sum_abs;
      tol[o] += wt * (allow + down_rel * (sum_abs + allow) + std::fabs(y) * 0x1p-22);
    }
  }
  Reference r;
  for (size_t o = 0; o < out.size(); ++o) {
    r.out.push_back(static_cast<float>(out[o]));
    // The combine's fp32 sum of k terms, then the output dtype's rounding (half an ulp: 2^-8 relative for bf16,
    // 2^-11 for f16), plus a floor for exact zeros.
    const double out_ulp = act == DType::kBF16 ? 0x1p-8 : act == DType::kF16 ? 0x1p-11 : 0x1p-23;
    r.tol.push_back(static_cast<float>(tol[o] * (1.0 + out_ulp) + (std::fabs(out[o]) + tol[o]) * out_ulp +
                                       mag[o] * 0x1p-22 + 1e-30));
  }
  return r;
}

double fp32_acc_rel(int64_t K) {
  return kAccRandom * std::sqrt(static_cast<double>(K)) * 0x1p-24;
}
[[maybe_unused]] double tensor_core_acc_rel(int64_t K) {
  return 0x1p-11 + fp32_acc_rel(K);
}

::testing::AssertionResult within(const std::vector<float>& got, const Reference& ref) {
  size_t worst = 0;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - ref.out[i]);
    const double ratio = std::isnan(got[i]) ? 1e30 : d / ref.tol[i];
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (worst_ratio <= 1.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "element " << worst << ": got " << got[worst] << ", want " << ref.out[worst]
                                       << " +- " << ref.tol[worst] << " (" << worst_ratio << " x the bound)";
}

struct Case {
  int64_t T, E, k, D, I;
  bool up_static, down_static;  // the projection quantizes its input (W8A8)
  int64_t skip = -1;            // an expert no token picks
  bool dynamic = false;         // W8A8 with dynamic scales (ActQuant::kDynamic) rather than calibrated static ones
  ops::ActQuant up_act() const {
    return up_static ? (dynamic ? ops::ActQuant::kDynamic : ops::ActQuant::kStatic) : ops::ActQuant::kNone;
  }
  ops::ActQuant down_act() const {
    return down_static ? (dynamic ? ops::ActQuant::kDynamic : ops::ActQuant::kStatic) : ops::ActQuant::kNone;
  }
};

// Inputs, weights and calibrated scales of one case. x values representable in `act`.
struct Inputs {
  Tensor x, ids, w;
  Fp8Experts s;
};
Inputs make_inputs(test::Rng& rng, const Case& c, DType act) {
  Inputs in;
  in.x = rng.normal_tensor({c.T, c.D}, 1.0f);
  for (int64_t i = 0; i < in.x.numel(); ++i) in.x.f32()[i] = round_act(in.x.f32()[i], act);
  make_routing(rng, c.T, c.E, c.k, c.skip, in.ids, in.w);
  in.s.up = make_weights(rng, c.E, c.I, c.D, c.up_act(), "layers.0.mixer.experts.{e}.up_proj", in.s.up_w);
  in.s.down = make_weights(rng, c.E, c.D, c.I, c.down_act(), "layers.0.mixer.experts.{e}.down_proj", in.s.down_w);
  // Calibration: amax of each expert's inputs over this batch (up: x rows routed to it; down: its relu^2 output).
  std::vector<float> amax_up(static_cast<size_t>(c.E), 0.0f), amax_down(static_cast<size_t>(c.E), 0.0f);
  for (int64_t p = 0; p < c.T * c.k; ++p) {
    const int64_t e = in.ids.i32()[p], t = p / c.k;
    const size_t ue = static_cast<size_t>(e);
    for (int64_t d = 0; d < c.D; ++d) amax_up[ue] = std::max(amax_up[ue], std::fabs(in.x.f32()[t * c.D + d]));
  }
  set_input_scales(rng, in.s.up, amax_up);
  for (int64_t p = 0; p < c.T * c.k; ++p) {
    const int64_t e = in.ids.i32()[p], t = p / c.k;
    const size_t ue = static_cast<size_t>(e);
    for (int64_t i = 0; i < c.I; ++i) {
      double h = 0.0;
      for (int64_t d = 0; d < c.D; ++d) h += in.x.f32()[t * c.D + d] * in.s.up_w[(e * c.I + i) * c.D + d];
      const double r = std::max(h, 0.0);
      amax_down[ue] = std::max(amax_down[ue], static_cast<float>(r * r));
    }
  }
  set_input_scales(rng, in.s.down, amax_down);
  return in;
}

std::vector<float> to_vector(const Tensor& t) {
  const Tensor f = t.to_f32();
  return std::vector<float>(f.f32(), f.f32() + f.numel());
}

TEST(Fp8Experts, CpuWeightOnlyIsTheDenseExpertsOnDequantizedWeights) {
  auto rng = test::Rng::for_test();
  const Case c{9, 5, 2, 40, 24, false, false, 3};
  const Inputs in = make_inputs(rng, c, DType::kF32);
  Tensor got = Tensor::empty(DType::kF32, {c.T, c.D});
  cpu::moe_experts_fp8(got, in.x, in.ids, in.w, in.s.up, in.s.down);
  std::vector<Tensor> up, down;
  for (int64_t e = 0; e < c.E; ++e) {
    up.push_back(Tensor::from_f32(
        {c.I, c.D}, std::span<const float>(in.s.up_w.data() + e * c.I * c.D, static_cast<size_t>(c.I * c.D))));
    down.push_back(Tensor::from_f32(
        {c.D, c.I}, std::span<const float>(in.s.down_w.data() + e * c.D * c.I, static_cast<size_t>(c.D * c.I))));
  }
  Tensor want = Tensor::empty(DType::kF32, {c.T, c.D});
  ops::moe_experts(ops::Context{}, want, in.x, in.ids, in.w, up, down);
  EXPECT_ALL_CLOSE(got, want, (test::Tolerance{1e-6f, 1e-5f}));
}

TEST(Fp8Experts, CpuMatchesNaiveLoop) {
  auto rng = test::Rng::for_test();
  for (const Case& c :
       {Case{1, 5, 1, 48, 32, true, true}, Case{9, 5, 2, 40, 24, true, true, 2}, Case{64, 5, 2, 70, 42, true, false},
        Case{33, 128, 6, 32, 48, true, true}, Case{8, 5, 2, 40, 24, false, true},
        Case{9, 5, 2, 40, 24, true, true, 2, true}, Case{64, 5, 2, 70, 42, true, false, -1, true},
        Case{33, 128, 6, 32, 48, false, true, -1, true}}) {
    SCOPED_TRACE(testing::Message() << "T " << c.T << " E " << c.E << " k " << c.k << " D " << c.D << " I " << c.I
                                    << " up " << ops::act_quant_name(c.up_act()) << " down "
                                    << ops::act_quant_name(c.down_act()));
    for (DType act : {DType::kF32, DType::kBF16}) {
      const Inputs in = make_inputs(rng, c, act);
      Tensor got = Tensor::empty(DType::kF32, {c.T, c.D});
      cpu::moe_experts_fp8(got, in.x, in.ids, in.w, in.s.up, in.s.down, act);
      EXPECT_TRUE(within(to_vector(got), naive(in.x, in.ids, in.w, in.s, act, fp32_acc_rel)));
    }
  }
}

TEST(Fp8Experts, CpuRejectsBadWeights) {
  auto rng = test::Rng::for_test();
  const Case c{3, 5, 2, 32, 16, true, true};
  Inputs in = make_inputs(rng, c, DType::kF32);
  Tensor out = Tensor::empty(DType::kF32, {c.T, c.D});
  {
    ops::ExpertWeights bad = in.s.up;
    bad.host_input_scale.pop_back();
    EXPECT_TRUE(test::throws_error([&] { cpu::moe_experts_fp8(out, in.x, in.ids, in.w, bad, in.s.down); },
                                   ErrorKind::kInvalidInput, "up_proj.input_scale"));
  }
  {
    ops::ExpertWeights bad = in.s.down;
    bad.host_input_scale[1] = 0.0f;
    EXPECT_TRUE(test::throws_error([&] { cpu::moe_experts_fp8(out, in.x, in.ids, in.w, in.s.up, bad); },
                                   ErrorKind::kInvalidInput, "input_scale of expert 1"));
  }
  {
    ops::ExpertWeights bad = in.s.down;
    bad.weight = Tensor::empty(DType::kF8E4M3, {c.E, c.D + 16, c.I});
    EXPECT_TRUE(test::throws_error([&] { cpu::moe_experts_fp8(out, in.x, in.ids, in.w, in.s.up, bad); },
                                   ErrorKind::kInvalidInput, "down_proj.weight"));
  }
  {
    ops::ExpertWeights bad = in.s.up;
    bad.format = ops::WeightFormat::kNvfp4;
    EXPECT_TRUE(test::throws_error([&] { cpu::moe_experts_fp8(out, in.x, in.ids, in.w, bad, in.s.down); },
                                   ErrorKind::kInvalidInput, "expected fp8"));
  }
}

#ifdef CHIMERA_HAVE_CUDA
ops::ExpertWeights on_device(const ops::ExpertWeights& w) {
  ops::ExpertWeights d = w;
  d.weight = device::to_device(w.weight, Device::kCuda);
  d.scale = device::to_device(w.scale, Device::kCuda);
  if (w.input_scale) d.input_scale = device::to_device(w.input_scale, Device::kCuda);
  return d;
}

std::vector<float> run_cuda(const Inputs& in, DType act, cuda::moe::Fp8ExpertsPath path) {
  const ops::ExpertWeights up = on_device(in.s.up), down = on_device(in.s.down);
  Tensor o = device::empty(Device::kCuda, act, in.x.shape());
  Tensor poison = Tensor::empty(act, in.x.shape());
  std::memset(poison.data(), 0xff, poison.nbytes());
  device::copy(o, poison);
  const Tensor dx = device::to_device(in.x, Device::kCuda, act), dids = device::to_device(in.ids, Device::kCuda);
  const Tensor dw = device::to_device(in.w, Device::kCuda);
  cuda::moe::moe_experts_fp8_on_path(ops::Context{Device::kCuda, nullptr}, o, dx, dids, dw, up, down, path);
  return to_vector(device::to_host_f32(o));
}

void cuda_case(test::Rng& rng, const Case& c, DType act, cuda::moe::Fp8ExpertsPath path) {
  SCOPED_TRACE(testing::Message() << "T " << c.T << " E " << c.E << " k " << c.k << " D " << c.D << " I " << c.I
                                  << " up " << ops::act_quant_name(c.up_act()) << " down "
                                  << ops::act_quant_name(c.down_act()) << " " << dtype_name(act) << " path "
                                  << static_cast<int>(path));
  const Inputs in = make_inputs(rng, c, act);
  // The automatic choice may take the tensor cores (bf16): their bound, which contains the fp32 one.
  const bool tc = act == DType::kBF16 && path != cuda::moe::Fp8ExpertsPath::kGemv;
  const Reference ref = naive(in.x, in.ids, in.w, in.s, act, tc ? tensor_core_acc_rel : fp32_acc_rel);
  const std::vector<float> got = run_cuda(in, act, path);
  EXPECT_TRUE(within(got, ref));
  if (tc) {
    // The tensor cores' bound above is the worst case of truncating accumulation and excuses many e4m3 flips of hq;
    // their typical effect is a relative RMS of about sqrt(flip fraction) x one e4m3 step (~2^-4): a few percent at
    // most. A wrong scale, expert or row moves the whole output, far beyond 5 %.
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = static_cast<double>(got[i]) - ref.out[i];
      num += d * d;
      den += static_cast<double>(ref.out[i]) * ref.out[i];
    }
    EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 0.05) << "relative RMS error of the tensor-core path";
  }
  // And against the CPU reference with the same rounding point: within the sum of both bounds.
  Tensor cpu_out = Tensor::empty(DType::kF32, {c.T, c.D});
  cpu::moe_experts_fp8(cpu_out, in.x, in.ids, in.w, in.s.up, in.s.down, act);
  Reference both = ref;
  const std::vector<float> cpu_v = to_vector(cpu_out);
  for (size_t i = 0; i < both.out.size(); ++i) {
    both.out[i] = cpu_v[i];
    both.tol[i] *= 2.0f;
  }
  EXPECT_TRUE(within(got, both)) << "CUDA vs CPU reference";
}

bool has_gpu() {
  return device::cuda_available();
}

TEST(Fp8Experts, CudaGemvMatchesReference) {
  if (!has_gpu()) GTEST_SKIP() << device::describe_cuda();
  auto rng = test::Rng::for_test();
  const auto gemv = cuda::moe::Fp8ExpertsPath::kGemv;
  for (DType act : {DType::kF32, DType::kBF16}) {
    for (int64_t T : {1, 3, 8, 9, 64, 257, 1000}) {
      cuda_case(rng, Case{T, 5, 2, 80, 48, true, true, 2}, act, gemv);
      cuda_case(rng, Case{T, 128, 6, 96, 64, true, true}, act, gemv);
    }
    // Not multiples of 16 (the scalar-load variant), top-1, weight-only and mixed.
    for (int64_t T : {1, 9, 257}) {
      cuda_case(rng, Case{T, 5, 1, 70, 42, true, true}, act, gemv);
      cuda_case(rng, Case{T, 5, 2, 80, 48, false, false}, act, gemv);
      cuda_case(rng, Case{T, 128, 6, 72, 40, false, false}, act, gemv);
      cuda_case(rng, Case{T, 5, 2, 80, 48, true, false}, act, gemv);
      // Dynamic scales (--quantization fp8): both projections, and one of them.
      cuda_case(rng, Case{T, 5, 2, 80, 48, true, true, 2, true}, act, gemv);
      cuda_case(rng, Case{T, 128, 6, 72, 40, true, true, -1, true}, act, gemv);
      cuda_case(rng, Case{T, 5, 2, 80, 48, false, true, -1, true}, act, gemv);
    }
  }
}

TEST(Fp8Experts, CudaGemvNanoShapes) {
  if (!has_gpu()) GTEST_SKIP() << device::describe_cuda();
  auto rng = test::Rng::for_test();
  // The experts' shapes are the models' ([1856, 2688] for Nano, Super's latent [2688, 1024] at top-22); fewer experts
  // than the models' 128 / 512 keep the random weights and the double-precision reference to seconds (the kernels
  // index experts by id, so their count changes nothing the test could catch).
  for (int64_t T : {1, 3, 8}) {
    cuda_case(rng, Case{T, 8, 6, 2688, 1856, true, true}, DType::kBF16, cuda::moe::Fp8ExpertsPath::kGemv);
  }
  cuda_case(rng, Case{2, 8, 6, 2688, 1856, false, false}, DType::kBF16, cuda::moe::Fp8ExpertsPath::kGemv);
  cuda_case(rng, Case{2, 24, 22, 1024, 2688, true, true}, DType::kBF16, cuda::moe::Fp8ExpertsPath::kGemv);
  // These shapes take the persistent GEMV: with dynamic scales (--quantization fp8: x's from every block's own
  // reduction, r's from the up launch's per-block maxima), one projection quantized, and F16 activations.
  for (int64_t T : {1, 5, 8}) {
    cuda_case(rng, Case{T, 8, 6, 2688, 1856, true, true, -1, true}, DType::kBF16, cuda::moe::Fp8ExpertsPath::kGemv);
  }
  cuda_case(rng, Case{4, 8, 6, 2688, 1856, false, true, 3, true}, DType::kBF16, cuda::moe::Fp8ExpertsPath::kGemv);
  cuda_case(rng, Case{3, 24, 22, 1024, 2688, true, false}, DType::kF16, cuda::moe::Fp8ExpertsPath::kGemv);
  cuda_case(rng, Case{1, 8, 6, 2688, 1856, true, true, -1, true}, DType::kF16, cuda::moe::Fp8ExpertsPath::kGemv);
}

TEST(Fp8Experts, CudaCutlassMatchesReference) {
  if (!has_gpu()) GTEST_SKIP() << device::describe_cuda();
#ifndef CHIMERA_HAVE_CUTLASS
  GTEST_SKIP() << "built without CUTLASS (cmake -DCHIMERA_CUTLASS=ON)";
#endif
  auto rng = test::Rng::for_test();
  const auto path = cuda::moe::Fp8ExpertsPath::kCutlass;
  for (int64_t T : {1, 3, 8, 9, 64, 257, 1000}) {
    cuda_case(rng, Case{T, 5, 2, 80, 48, true, true, 2}, DType::kBF16, path);
    cuda_case(rng, Case{T, 128, 6, 96, 64, true, true}, DType::kBF16, path);
  }
  cuda_case(rng, Case{257, 5, 1, 144, 272, true, true}, DType::kBF16, path);
  cuda_case(rng, Case{96, 8, 6, 2688, 1856, true, true}, DType::kBF16, path);  // Nano's expert shapes
  // Dynamic scales: the up GEMM writes bf16 r, quantized with its own scale before the down GEMM.
  for (int64_t T : {1, 9, 64, 257}) cuda_case(rng, Case{T, 128, 6, 96, 64, true, true, -1, true}, DType::kBF16, path);
  cuda_case(rng, Case{96, 8, 6, 2688, 1856, true, true, -1, true}, DType::kBF16, path);
  // Outside its domain (weight-only, fp32 activations, K % 16 != 0): a clear error, not a wrong answer.
  {
    const Inputs in = make_inputs(rng, Case{9, 5, 2, 80, 48, false, false}, DType::kBF16);
    EXPECT_TRUE(test::throws_error([&] { run_cuda(in, DType::kBF16, path); }, ErrorKind::kRuntime, "cutlass"));
  }
  {
    const Inputs in = make_inputs(rng, Case{9, 5, 2, 70, 42, true, true}, DType::kBF16);
    EXPECT_TRUE(test::throws_error([&] { run_cuda(in, DType::kBF16, path); }, ErrorKind::kRuntime, "cutlass"));
  }
}

TEST(Fp8Experts, CudaAutoPicksAWorkingPath) {
  if (!has_gpu()) GTEST_SKIP() << device::describe_cuda();
  auto rng = test::Rng::for_test();
  const auto path = cuda::moe::Fp8ExpertsPath::kAuto;
  cuda_case(rng, Case{1, 128, 6, 96, 64, true, true}, DType::kBF16, path);
  cuda_case(rng, Case{257, 128, 6, 96, 64, true, true}, DType::kBF16, path);
  cuda_case(rng, Case{257, 5, 2, 70, 42, true, true}, DType::kBF16, path);
  cuda_case(rng, Case{257, 5, 2, 80, 48, false, false}, DType::kBF16, path);
  cuda_case(rng, Case{64, 5, 2, 80, 48, true, true}, DType::kF32, path);
  cuda_case(rng, Case{257, 128, 6, 96, 64, true, true, -1, true}, DType::kBF16, path);
}
#endif

}  // namespace
}  // namespace chimera
