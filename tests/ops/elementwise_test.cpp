// add, copy_columns, write_columns (on CUDA also bf16 / f16 and model shapes), and the dispatch checks of a CUDA
// context.
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"

namespace chimera {
namespace {

using test::BackendTest;

// F32 values as they are after a round trip through `dtype`.
Tensor rounded(const Tensor& f32, DType dtype) {
  return test::cast_to(f32, dtype).to_f32();
}

class OpsElementwise : public BackendTest {
 protected:
  std::vector<DType> act_dtypes() const {
    return on_cuda() ? std::vector<DType>{DType::kF32, DType::kBF16, DType::kF16} : std::vector<DType>{DType::kF32};
  }
};

TEST_P(OpsElementwise, AddMatchesNaiveAndMayAlias) {
  auto rng = test::Rng::for_test();
  std::vector<Shape> shapes = {{17, 33}};
  if (on_cuda()) shapes.insert(shapes.end(), {{1, 8191}, {4099, 333}, {3, 5, 7}});
  for (DType act : act_dtypes()) {
    for (const Shape& shape : shapes) {
      SCOPED_TRACE(::testing::Message() << shape_str(shape) << " " << dtype_name(act));
      const Tensor a = rounded(rng.normal_tensor(shape), act), b = rounded(rng.normal_tensor(shape), act);
      Tensor want = Tensor::empty(DType::kF32, shape);
      for (int64_t i = 0; i < a.numel(); ++i) want.f32()[i] = a.f32()[i] + b.f32()[i];
      want = rounded(want, act);  // one fp32 add, one rounding
      Tensor out = output(act, shape);
      const Tensor da = on_backend(a, act), db = on_backend(b, act);
      ops::add(ctx(), out, da, db);
      EXPECT_TRUE(test::bit_equal(host_f32(out), want));
      Tensor acc = on_backend(a, act);
      ops::add(ctx(), acc, acc, db);
      EXPECT_TRUE(test::bit_equal(host_f32(acc), want));
    }
  }
  const Tensor a = on_backend(rng.normal_tensor({17, 33}));
  Tensor out = output(DType::kF32, {17, 33});
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::add(ctx(), out, a, on_backend(Tensor::zeros(DType::kF32, {17, 32})));
      },
      ErrorKind::kRuntime, "ops::add: b F32[17, 32] does not match a F32[17, 33]"));
  if (on_cuda()) {
    EXPECT_TRUE(test::throws_error([&] { ops::add(ctx(), out, a, on_backend(a, DType::kBF16)); }, ErrorKind::kRuntime,
                                   "ops::add: the activations of one call must share a dtype on CUDA, got a F32[17, "
                                   "33], b BF16[17, 33], out F32[17, 33]"));
  }
}

TEST_P(OpsElementwise, CopyColumns) {
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t T, W, begin, w;
  };
  std::vector<Case> cases = {{3, 500, 389, 111}};
  // The Mamba in_proj split of Nano (z | xBC | dt of 4096 | 6144 | 64 columns) at awkward token counts.
  if (on_cuda()) cases.insert(cases.end(), {{1, 10304, 0, 4096}, {333, 10304, 4096, 6144}, {17, 10304, 10240, 64}});
  for (DType act : act_dtypes()) {
    for (const Case& k : cases) {
      SCOPED_TRACE(::testing::Message() << "T=" << k.T << " W=" << k.W << " begin=" << k.begin << " "
                                        << dtype_name(act));
      const Tensor in = rounded(rng.normal_tensor({k.T, k.W}), act);
      Tensor out = output(act, {k.T, k.w});
      ops::copy_columns(ctx(), out, on_backend(in, act), k.begin);
      const Tensor got = host_f32(out);
      for (int64_t t = 0; t < k.T; ++t) {
        for (int64_t c = 0; c < k.w; ++c) ASSERT_EQ(got.f32()[t * k.w + c], in.f32()[t * k.W + k.begin + c]);
      }
    }
  }
  const Tensor in = on_backend(rng.normal_tensor({3, 500}));
  Tensor out = output(DType::kF32, {3, 111});
  EXPECT_TRUE(test::throws_error([&] { ops::copy_columns(ctx(), out, in, 390); }, ErrorKind::kRuntime,
                                 "ops::copy_columns: out F32[3, 111] does not match columns [390, 501)"));
}

// The MTP head's concat[enorm(e), hnorm(h)]: two parts written side by side, every other column untouched.
TEST_P(OpsElementwise, WriteColumns) {
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t T, W, begin, w;
  };
  std::vector<Case> cases = {{3, 500, 389, 111}, {5, 128, 0, 64}, {5, 128, 64, 64}};
  if (on_cuda()) cases.insert(cases.end(), {{1, 8192, 4096, 4096}, {333, 5376, 2688, 2688}});
  for (DType act : act_dtypes()) {
    for (const Case& k : cases) {
      SCOPED_TRACE(::testing::Message() << "T=" << k.T << " W=" << k.W << " begin=" << k.begin << " "
                                        << dtype_name(act));
      const Tensor base = rounded(rng.normal_tensor({k.T, k.W}), act);
      const Tensor in = rounded(rng.normal_tensor({k.T, k.w}), act);
      // What out must hold, taken before the call (on the CPU `out` may share base's buffer).
      std::vector<float> want(base.f32(), base.f32() + base.numel());
      for (int64_t t = 0; t < k.T; ++t) {
        for (int64_t c = 0; c < k.w; ++c) want[static_cast<size_t>(t * k.W + k.begin + c)] = in.f32()[t * k.w + c];
      }
      Tensor out = on_backend(base, act);
      ops::write_columns(ctx(), out, on_backend(in, act), k.begin);
      const Tensor got = host_f32(out);
      for (int64_t i = 0; i < k.T * k.W; ++i) {
        ASSERT_EQ(got.f32()[i], want[static_cast<size_t>(i)]) << "row " << i / k.W << " column " << i % k.W;
      }
    }
  }
  const Tensor in = on_backend(rng.normal_tensor({3, 111}));
  Tensor out = output(DType::kF32, {3, 500});
  EXPECT_TRUE(test::throws_error([&] { ops::write_columns(ctx(), out, in, 390); }, ErrorKind::kRuntime,
                                 "ops::write_columns: in F32[3, 111] does not match columns [390, 501)"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsElementwise);

TEST(OpsDispatch, DeviceMismatchIsCaughtBeforeDispatch) {
  // A "CUDA" tensor that is really host memory: never dereferenced, the checks stop the call first.
  static float buf[8] = {};
  const Tensor a = Tensor::wrap(buf, DType::kF32, {8}, nullptr, Device::kCuda);
  const Tensor h = Tensor::zeros(DType::kF32, {8});
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::add(ops::Context{Device::kCuda, nullptr}, a, h, a);
      },
      ErrorKind::kRuntime, "ops::add: a F32[8] is on the CPU but the context is CUDA"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::add(ops::Context{Device::kCpu, nullptr}, h, a, h);
      },
      ErrorKind::kRuntime, "ops::add: a F32[8] is on the CUDA but the context is CPU"));
}

#ifndef CHIMERA_HAVE_CUDA
TEST(OpsDispatch, CudaContextFailsWithoutACudaBuild) {
  static float buf[8] = {};
  const Tensor a = Tensor::wrap(buf, DType::kF32, {8}, nullptr, Device::kCuda);
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::add(ops::Context{Device::kCuda, nullptr}, a, a, a);
      },
      ErrorKind::kRuntime, "this build of chimera has no CUDA backend"));
}
#endif

}  // namespace
}  // namespace chimera
