// Attention with an FP8 E4M3 KV cache (--kv-cache-dtype fp8; ops.h KvCacheView) on every backend: a prefill step
// then a decode step over shuffled paged blocks.
//   * The cache holds exactly e4m3(x / scale) (round to nearest even, saturated at +-448): the CPU's encoder and
//     CUDA's must give the same bytes, also when x / scale overflows.
//   * The output equals a double oracle over the dequantized cache (e4m3 x scale) within the fp32 reduction bound.
//   * Against the same attention over an unquantized cache the output moves by at most a bound derived per row from
//     the quantization error: each element of k and v is off by at most 2^-4 of itself (3 mantissa bits) or half a
//     subnormal step (2^-10 x scale); a score s_u = scale_qk q . k_u moves by at most ds_u = scale_qk sum_d |q_d|
//     |dk_ud|, so the softmax weights move by ||dp||_1 <= 2 max_u ds_u, and the output by at most
//     max |dv| + max |v| x 2 max_u ds_u.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#include "common/tolerances.h"
#include "core/fp8.h"

namespace chimera {
namespace {

using test::BackendTest;

struct Fp8Case {
  int64_t Qh, KVh, hd, block_size;
  std::vector<int32_t> lens;  // prompt lengths; one decode token each follows
};

// The e4m3 value of x / scale, back in fp32 times scale: what attention reads for x.
float dequantized(float x, float scale) { return e4m3_to_f32(f32_to_e4m3(x / scale)) * scale; }
// Its worst-case error bound (normal range: 2^-4 relative; subnormal: half a 2^-9 step).
double quant_error_bound(float x, float scale) {
  return std::max(std::fabs(double(x)) / 16.0, double(scale) / 1024.0);
}

class OpsAttentionFp8Cache : public BackendTest {
 protected:
  struct Step {
    Tensor q, k, v;  // host F32, rounded to the activation dtype
    std::vector<int32_t> cu, context;
  };
  struct Result {
    Tensor out_prefill, out_decode;  // host F32
    Tensor k_cache, v_cache;         // host, the cache dtype
  };

  // The two steps for c (prefill of every prompt, then one token each), inputs rounded to `act`.
  std::vector<Step> make_steps(test::Rng& rng, const Fp8Case& c, DType act) const {
    std::vector<Step> steps(2);
    int64_t T = 0;
    for (int32_t n : c.lens) T += n;
    const int64_t S = static_cast<int64_t>(c.lens.size());
    const int64_t rows[2] = {T, S};
    for (int i = 0; i < 2; ++i) {
      Step& st = steps[static_cast<size_t>(i)];
      st.q = test::cast_to(rng.normal_tensor({rows[i], c.Qh, c.hd}), act).to_f32();
      st.k = test::cast_to(rng.normal_tensor({rows[i], c.KVh, c.hd}), act).to_f32();
      st.v = test::cast_to(rng.normal_tensor({rows[i], c.KVh, c.hd}), act).to_f32();
      st.cu.push_back(0);
      for (int64_t s = 0; s < S; ++s) {
        st.cu.push_back(st.cu.back() + (i == 0 ? c.lens[static_cast<size_t>(s)] : 1));
        st.context.push_back(i == 0 ? 0 : c.lens[static_cast<size_t>(s)]);
      }
    }
    return steps;
  }

  // Sequence s owns blocks_per_seq blocks, handed out in reverse so that no sequence's blocks are in order.
  static Tensor block_tables(const Fp8Case& c, int64_t blocks_per_seq) {
    const int64_t S = static_cast<int64_t>(c.lens.size());
    std::vector<int32_t> t(static_cast<size_t>(S * blocks_per_seq));
    for (int64_t i = 0; i < S * blocks_per_seq; ++i) t[static_cast<size_t>(i)] = static_cast<int32_t>(S * blocks_per_seq - 1 - i);
    return Tensor::from_i32({S, blocks_per_seq}, t);
  }

  Result run(const Fp8Case& c, const std::vector<Step>& steps, DType act, bool fp8, float k_scale,
             float v_scale) const {
    const int32_t longest = *std::max_element(c.lens.begin(), c.lens.end()) + 1;
    const int64_t bps = (longest + c.block_size - 1) / c.block_size;
    const int64_t num_blocks = bps * static_cast<int64_t>(c.lens.size());
    const DType cd = fp8 ? DType::kF8E4M3 : act;
    ops::KvCacheView cache{device::empty(GetParam(), cd, {num_blocks, c.block_size, c.KVh, c.hd}),
                           device::empty(GetParam(), cd, {num_blocks, c.block_size, c.KVh, c.hd}), k_scale, v_scale};
    device::zero(cache.k);
    device::zero(cache.v);
    const Tensor tables = on_backend(block_tables(c, bps));
    Result r;
    for (size_t i = 0; i < steps.size(); ++i) {
      const Step& st = steps[i];
      const Tensor out = output(act, st.q.shape());
      ops::attention(ctx(), out, on_backend(st.q, act), on_backend(st.k, act), on_backend(st.v, act), cache, st.cu,
                     st.context, tables, 1.0f / std::sqrt(static_cast<float>(c.hd)));
      (i == 0 ? r.out_prefill : r.out_decode) = host_f32(out);
    }
    r.k_cache = device::to_host(cache.k);
    r.v_cache = device::to_host(cache.v);
    return r;
  }

  // Every query row of both steps against the double oracle over the dequantized history, and (scales that do
  // not saturate) against the unquantized cache within the derived bound.
  void check(test::Rng& rng, const Fp8Case& c, DType act, float k_scale, float v_scale, bool saturates) {
    SCOPED_TRACE(::testing::Message() << "Qh=" << c.Qh << " KVh=" << c.KVh << " hd=" << c.hd << " block="
                                      << c.block_size << " act=" << dtype_name(act) << " scales " << k_scale << " / "
                                      << v_scale);
    const std::vector<Step> steps = make_steps(rng, c, act);
    const Result got = run(c, steps, act, true, k_scale, v_scale);
    const Result plain = run(c, steps, act, false, 1.0f, 1.0f);
    const int32_t longest = *std::max_element(c.lens.begin(), c.lens.end()) + 1;
    const int64_t bps = (longest + c.block_size - 1) / c.block_size;
    const Tensor tables = block_tables(c, bps);
    const float scale_qk = 1.0f / std::sqrt(static_cast<float>(c.hd));
    const int64_t KVh = c.KVh, hd = c.hd, group = c.Qh / c.KVh;
    for (size_t s = 0; s < c.lens.size(); ++s) {
      const int64_t n = c.lens[s] + 1;  // positions of the prompt and the decode token
      // The history of sequence s: rows of k / v by position, from the two steps.
      auto source = [&](int64_t pos, Tensor Step::*which) -> const float* {
        const Step& st = steps[pos < c.lens[s] ? 0 : 1];
        const int64_t row = pos < c.lens[s] ? st.cu[s] + pos : static_cast<int64_t>(s);
        return (st.*which).f32() + row * KVh * hd;
      };
      for (int64_t pos = 0; pos < n; ++pos) {  // the cache bytes
        const int64_t blk = tables.i32()[static_cast<int64_t>(s) * bps + pos / c.block_size];
        const int64_t off = (blk * c.block_size + pos % c.block_size) * KVh * hd;
        const auto* kb = static_cast<const uint8_t*>(got.k_cache.data()) + off;
        const auto* vb = static_cast<const uint8_t*>(got.v_cache.data()) + off;
        for (int64_t e = 0; e < KVh * hd; ++e) {
          ASSERT_EQ(kb[e], f32_to_e4m3(source(pos, &Step::k)[e] / k_scale)) << "k seq " << s << " pos " << pos;
          ASSERT_EQ(vb[e], f32_to_e4m3(source(pos, &Step::v)[e] / v_scale)) << "v seq " << s << " pos " << pos;
        }
      }
      if (saturates) continue;
      for (int64_t pos = 0; pos < n; ++pos) {  // query rows: prompt positions (prefill) and the decode token
        const bool dec = pos == n - 1;
        const Step& st = steps[dec ? 1 : 0];
        const int64_t row = dec ? static_cast<int64_t>(s) : st.cu[s] + pos;
        const float* q = st.q.f32() + row * c.Qh * hd;
        const Tensor& out = dec ? got.out_decode : got.out_prefill;
        const Tensor& ref = dec ? plain.out_decode : plain.out_prefill;
        for (int64_t j = 0; j < c.Qh; ++j) {
          const int64_t kvh = j / group;
          std::vector<double> sc(static_cast<size_t>(pos + 1)), ds(static_cast<size_t>(pos + 1));
          double max_v = 0, max_dv = 0;
          for (int64_t u = 0; u <= pos; ++u) {
            const float* kr = source(u, &Step::k) + kvh * hd;
            const float* vr = source(u, &Step::v) + kvh * hd;
            double d = 0, dd = 0;
            for (int64_t e = 0; e < hd; ++e) {
              d += double(q[j * hd + e]) * dequantized(kr[e], k_scale);
              dd += std::fabs(double(q[j * hd + e])) * quant_error_bound(kr[e], k_scale);
              max_v = std::max(max_v, std::fabs(double(vr[e])));
              max_dv = std::max(max_dv, quant_error_bound(vr[e], v_scale));
            }
            sc[u] = d * scale_qk;
            ds[u] = dd * scale_qk;
          }
          const double m = *std::max_element(sc.begin(), sc.end());
          double sum = 0;
          for (double& x : sc) sum += (x = std::exp(x - m));
          const double bound = max_dv + max_v * 2.0 * *std::max_element(ds.begin(), ds.end());
          for (int64_t e = 0; e < hd; ++e) {
            double o = 0;
            for (int64_t u = 0; u <= pos; ++u) o += sc[u] * dequantized(source(u, &Step::v)[kvh * hd + e], v_scale);
            o /= sum;
            const double g = out.f32()[(row * c.Qh + j) * hd + e];
            const test::Tolerance tol = act == DType::kF32 ? test::kF32Reduction : test::kBF16Elementwise;
            ASSERT_LE(std::fabs(g - o), tol.abs + tol.rel * std::fabs(o))
                << "seq " << s << " pos " << pos << " head " << j << " e " << e << ": " << g << " vs oracle " << o;
            const double r = ref.f32()[(row * c.Qh + j) * hd + e];
            ASSERT_LE(std::fabs(g - r), bound + tol.abs + tol.rel * std::fabs(r))
                << "seq " << s << " pos " << pos << " head " << j << " vs the unquantized cache";
          }
        }
      }
    }
  }
};

TEST_P(OpsAttentionFp8Cache, CacheBytesAndOutputsMatchTheDequantizedOracleAndTheDerivedBound) {
  auto rng = test::Rng::for_test();
  const std::vector<DType> acts = on_cuda() ? std::vector<DType>{DType::kF32, DType::kBF16}
                                            : std::vector<DType>{DType::kF32};
  for (const DType act : acts) {
    check(rng, {4, 2, 16, 16, {1, 17, 5}}, act, 0.37f, 0.021f, false);
    check(rng, {6, 3, 64, 16, {33, 2}}, act, 1.0f, 1.0f, false);  // the checkpoint-less default scales
    check(rng, {8, 1, 128, 64, {70}}, act, 0.05f, 2.5f, false);
    check(rng, {2, 2, 24, 8, {9, 12}}, act, 0.002f, 0.004f, true);  // x / scale beyond 448: saturated bytes
  }
}

TEST_P(OpsAttentionFp8Cache, RejectsMixedOrBadlyScaledCaches) {
  const Tensor q = on_backend(Tensor::zeros(DType::kF32, {1, 2, 8}));
  const Tensor kv = on_backend(Tensor::zeros(DType::kF32, {1, 1, 8}));
  const Tensor out = output(DType::kF32, {1, 2, 8});
  const std::vector<int32_t> table{0};
  const Tensor tables = on_backend(Tensor::from_i32({1, 1}, table));
  const Tensor fp8 = device::empty(GetParam(), DType::kF8E4M3, {1, 4, 1, 8});
  const Tensor f32 = device::empty(GetParam(), DType::kF32, {1, 4, 1, 8});
  const std::vector<int32_t> cu{0, 1}, context{0};
  EXPECT_TRUE(test::throws_error(
      [&] { ops::attention(ctx(), out, q, kv, kv, ops::KvCacheView{fp8, f32}, cu, context, tables, 1.0f); },
      ErrorKind::kRuntime, "must both be 4-D F8_E4M3"));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::attention(ctx(), out, q, kv, kv, ops::KvCacheView{fp8, fp8, 0.0f, 1.0f}, cu, context, tables, 1.0f); },
      ErrorKind::kRuntime, "must be finite and > 0"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsAttentionFp8Cache);

}  // namespace
}  // namespace chimera
