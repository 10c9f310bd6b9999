// Device services: allocation, copies with dtype conversion, the caching allocator's reuse. Runs on a GPU;
// skips cleanly without one.
#include "backends/device_api.h"

#include <gtest/gtest.h>

#include "common/compare.h"

namespace chimera {
namespace {

class DeviceApi : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  }
};

TEST_F(DeviceApi, RoundTripsEveryFloatDtype) {
  test::Rng rng = test::Rng::for_test();
  const Tensor h = rng.normal_tensor({37, 11});
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    const Tensor dev = device::to_device(h, Device::kCuda, d);
    EXPECT_EQ(dev.device(), Device::kCuda);
    EXPECT_EQ(dev.dtype(), d);
    const Tensor back = device::to_host_f32(dev);
    const test::Tolerance tol = d == DType::kF32 ? test::Tolerance{0, 0} : test::kBF16Elementwise;
    EXPECT_ALL_CLOSE(back, h, tol);
  }
}

TEST_F(DeviceApi, CachingAllocatorReusesFreedBlocks) {
  const auto before = device::cuda_memory_stats();
  void* first = nullptr;
  {
    Tensor a = device::empty(Device::kCuda, DType::kF32, {1000});
    first = a.data();
    EXPECT_GT(device::cuda_memory_stats().first, before.first);
  }
  Tensor b = device::empty(Device::kCuda, DType::kF32, {1000});
  EXPECT_EQ(b.data(), first);
}

TEST(DeviceApiNoGpu, DescribesTheDevice) { EXPECT_FALSE(device::describe_cuda().empty()); }

}  // namespace
}  // namespace chimera
