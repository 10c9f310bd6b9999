// add, copy_columns, and the dispatch of a CUDA context while the CUDA backend is not built.
#include "common/backend_param.h"
#include "common/compare.h"

namespace chimera {
namespace {

using test::BackendTest;

class OpsElementwise : public BackendTest {};

TEST_P(OpsElementwise, AddMatchesNaiveAndMayAlias) {
  auto rng = test::Rng::for_test();
  const Tensor a = rng.normal_tensor({17, 33}), b = rng.normal_tensor({17, 33});
  Tensor want = Tensor::empty(DType::kF32, {17, 33});
  for (int64_t i = 0; i < a.numel(); ++i) want.f32()[i] = a.f32()[i] + b.f32()[i];
  Tensor out = Tensor::empty(DType::kF32, {17, 33});
  test::poison(out);
  ops::add(ctx(), out, a, b);
  EXPECT_TRUE(test::bit_equal(out, want));
  Tensor acc = a.clone();
  ops::add(ctx(), acc, acc, b);
  EXPECT_TRUE(test::bit_equal(acc, want));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::add(ctx(), out, a, Tensor::zeros(DType::kF32, {17, 32}));
      },
      ErrorKind::kRuntime, "ops::add: b F32[17, 32] does not match a F32[17, 33]"));
}

TEST_P(OpsElementwise, CopyColumns) {
  auto rng = test::Rng::for_test();
  const Tensor in = rng.normal_tensor({3, 500});
  Tensor out = Tensor::empty(DType::kF32, {3, 111});
  test::poison(out);
  ops::copy_columns(ctx(), out, in, 389);
  for (int64_t t = 0; t < 3; ++t) {
    for (int64_t c = 0; c < 111; ++c) ASSERT_EQ(out.f32()[t * 111 + c], in.f32()[t * 500 + 389 + c]);
  }
  EXPECT_TRUE(test::throws_error([&] { ops::copy_columns(ctx(), out, in, 390); }, ErrorKind::kRuntime,
                                 "ops::copy_columns: out F32[3, 111] does not match columns [390, 501)"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsElementwise);

// Until the CUDA backend exists, a CUDA context is a clear runtime error naming the op.
TEST(OpsDispatch, DeviceMismatchIsCaughtBeforeDispatch) {
  // A "CUDA" tensor that is really host memory: never dereferenced, the checks stop the call first.
  static float buf[8] = {};
  const Tensor a = Tensor::wrap(buf, DType::kF32, {8}, nullptr, Device::kCuda);
  const Tensor h = Tensor::zeros(DType::kF32, {8});
  EXPECT_TRUE(test::throws_error([&] { ops::add(ops::Context{Device::kCuda, nullptr}, a, h, a); }, ErrorKind::kRuntime,
                                 "ops::add: a F32[8] is on the CPU but the context is CUDA"));
  EXPECT_TRUE(test::throws_error([&] { ops::add(ops::Context{Device::kCpu, nullptr}, h, a, h); }, ErrorKind::kRuntime,
                                 "ops::add: a F32[8] is on the CUDA but the context is CPU"));
}

#ifndef CHIMERA_HAVE_CUDA
TEST(OpsDispatch, CudaContextFailsWithoutACudaBuild) {
  static float buf[8] = {};
  const Tensor a = Tensor::wrap(buf, DType::kF32, {8}, nullptr, Device::kCuda);
  EXPECT_TRUE(test::throws_error([&] { ops::add(ops::Context{Device::kCuda, nullptr}, a, a, a); }, ErrorKind::kRuntime,
                                 "this build of chimera has no CUDA backend"));
}
#endif

}  // namespace
}  // namespace chimera
