#include "common/compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "backends/device_api.h"

namespace chimera::test {

::testing::AssertionResult all_close(std::span<const float> got, std::span<const float> want, Tolerance tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size mismatch: got " << got.size() << " want " << want.size();
  }
  size_t bad = 0, worst = 0;
  double worst_excess = -1.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    bool ok;
    double excess;
    if (std::isnan(g) || std::isnan(w)) {
      ok = std::isnan(g) && std::isnan(w);
      excess = ok ? 0.0 : std::numeric_limits<double>::infinity();
    } else {
      const double bound = tol.abs + tol.rel * std::fabs(w);
      excess = std::fabs(g - w) - bound;
      ok = excess <= 0.0;
    }
    if (!ok) ++bad;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << fmt::format(
             "{} of {} elements out of tolerance (abs {:g}, rel {:g}); worst at index {}: got {:.9g}, want {:.9g}",
             bad, got.size(), tol.abs, tol.rel, worst, got[worst], want[worst]);
}

static std::span<const float> as_f32(const Tensor& t, Tensor& holder) {
  holder = t.dtype() == DType::kF32 ? t : t.to_f32();
  return {holder.f32(), static_cast<size_t>(holder.numel())};
}

::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, Tolerance tol) {
  if (got.shape() != want.shape()) {
    return ::testing::AssertionFailure() << "shape mismatch: got " << got.describe() << " want " << want.describe();
  }
  Tensor hg, hw;
  return all_close(as_f32(got, hg), as_f32(want, hw), tol);
}

::testing::AssertionResult nmse_close(const Tensor& got, const Tensor& want, double nmse, Tolerance tol) {
  if (got.shape() != want.shape()) {
    return ::testing::AssertionFailure() << "shape mismatch: got " << got.describe() << " want " << want.describe();
  }
  Tensor hg, hw;
  auto g = as_f32(got, hg);
  auto w = as_f32(want, hw);
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double d = static_cast<double>(g[i]) - w[i];
    num += d * d;
    den += static_cast<double>(w[i]) * w[i];
  }
  const double e = num / std::max(den, 1e-30);
  if (!(e <= nmse)) {
    auto r = all_close(g, w, tol);
    return ::testing::AssertionFailure() << fmt::format("normalised MSE {:.3g} > {:.3g}; ", e, nmse)
                                         << r.message();
  }
  return all_close(g, w, tol);
}

::testing::AssertionResult within_bounds(const Tensor& got_any, std::span<const double> want,
                                         std::span<const double> bound) {
  const Tensor got = device::to_host_f32(got_any);
  if (got.numel() != static_cast<int64_t>(want.size()) || want.size() != bound.size()) {
    return ::testing::AssertionFailure() << "got " << got.describe() << " against " << want.size() << " values and "
                                         << bound.size() << " bounds";
  }
  int64_t worst = 0;
  double worst_ratio = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.f32()[i];
    const size_t u = static_cast<size_t>(i);
    const double ratio = std::isfinite(g) ? std::fabs(g - want[u]) / bound[u] : INFINITY;
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (worst_ratio <= 1.0) return ::testing::AssertionSuccess();
  const size_t w = static_cast<size_t>(worst);
  return ::testing::AssertionFailure() << "worst element " << worst << ": got " << got.f32()[worst] << ", want "
                                       << want[w] << ", bound " << bound[w] << " (" << worst_ratio << " x)";
}

::testing::AssertionResult bit_equal(const Tensor& got, const Tensor& want) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype()) {
    return ::testing::AssertionFailure() << "got " << got.describe() << " want " << want.describe();
  }
  const size_t es = dtype_size(got.dtype());
  const auto* a = static_cast<const unsigned char*>(got.data());
  const auto* b = static_cast<const unsigned char*>(want.data());
  for (int64_t i = 0; i < got.numel(); ++i) {
    if (std::memcmp(a + i * es, b + i * es, es) != 0) {
      std::string gv, wv;
      if (got.dtype() == DType::kI32) {
        gv = std::to_string(got.i32()[i]);
        wv = std::to_string(want.i32()[i]);
      } else {
        gv = fmt::format("{:g}", load_as_f32(a, got.dtype(), static_cast<size_t>(i)));
        wv = fmt::format("{:g}", load_as_f32(b, want.dtype(), static_cast<size_t>(i)));
      }
      return ::testing::AssertionFailure() << "first difference at element " << i << ": got " << gv << " want " << wv;
    }
  }
  return ::testing::AssertionSuccess();
}

Rng Rng::for_test() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  return Rng(std::hash<std::string>{}(name));
}

std::vector<int32_t> batch_slots(Rng& rng, int64_t batch, int64_t num_slots) {
  std::vector<int32_t> perm(static_cast<size_t>(num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.engine());
  std::vector<int32_t> slots;
  for (int64_t b = 0; b < batch; ++b) slots.push_back(b % 5 == 4 ? -1 : perm[static_cast<size_t>(b)]);
  return slots;
}

Tensor Rng::normal_tensor(Shape shape, float stddev) {
  Tensor t = Tensor::empty(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = normal(0.0f, stddev);
  return t;
}

Tensor Rng::uniform_tensor(Shape shape, float lo, float hi) {
  Tensor t = Tensor::empty(DType::kF32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = uniform(lo, hi);
  return t;
}

void poison(const Tensor& t) {
  if (t.dtype() == DType::kF32) {
    t.fill_f32(std::numeric_limits<float>::quiet_NaN());
  } else {
    std::memset(t.data(), 0xff, t.nbytes());  // NaN for bf16 / f16, -1 for integers
  }
}

std::string source_path(const std::string& relative) { return std::string(CHIMERA_SOURCE_DIR) + "/" + relative; }

}  // namespace chimera::test
