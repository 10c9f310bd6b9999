// One comparison helper: always asserts, and on failure prints the worst index with both values.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/tolerances.h"
#include "core/tensor.h"

namespace chimera::test {

// Elementwise |got - want| <= tol.abs + tol.rel * |want|; NaN in either side fails unless both are NaN.
::testing::AssertionResult all_close(std::span<const float> got, std::span<const float> want, Tolerance tol);
::testing::AssertionResult all_close(const Tensor& got, const Tensor& want, Tolerance tol);
// Normalised MSE: sum((got-want)^2) / max(sum(want^2), tiny) <= nmse, plus the elementwise bound.
::testing::AssertionResult nmse_close(const Tensor& got, const Tensor& want, double nmse, Tolerance tol);
// Elementwise against a derived per-element bound: |got[i] - want[i]| <= bound[i], a non-finite got[i] never
// passes. `got` may live on any device in any float dtype; on failure names the worst element.
::testing::AssertionResult within_bounds(const Tensor& got, std::span<const double> want,
                                         std::span<const double> bound);
// Bit-exact equality of the raw bytes (indices, routing choices, cache copies).
::testing::AssertionResult bit_equal(const Tensor& got, const Tensor& want);

#define EXPECT_ALL_CLOSE(got, want, tol) EXPECT_TRUE(::chimera::test::all_close((got), (want), (tol)))
#define ASSERT_ALL_CLOSE(got, want, tol) ASSERT_TRUE(::chimera::test::all_close((got), (want), (tol)))

// Fresh random inputs (never zeros) with a seed from the test name, so failures reproduce.
class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  static Rng for_test();  // seeded from the current gtest's full name
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  float normal(float mean = 0.0f, float stddev = 1.0f) { return std::normal_distribution<float>(mean, stddev)(gen_); }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen_); }
  Tensor normal_tensor(Shape shape, float stddev = 1.0f);             // F32
  Tensor uniform_tensor(Shape shape, float lo, float hi);             // F32
  std::mt19937_64& engine() { return gen_; }

 private:
  std::mt19937_64 gen_;
};

// State slots for a batch of Mamba sequences: a random permutation of num_slots (>= batch) slot ids, every fifth
// sequence a pad (-1), so some slots are used by nobody (conv1d, selective state update, fused decode tests).
std::vector<int32_t> batch_slots(Rng& rng, int64_t batch, int64_t num_slots);

// Fills a tensor with a NaN pattern so unwritten outputs are caught.
void poison(const Tensor& t);

// Paths of committed test data.
std::string source_path(const std::string& relative);  // CHIMERA_SOURCE_DIR / relative

}  // namespace chimera::test
