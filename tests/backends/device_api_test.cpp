// Device services: allocation, copies with dtype conversion, the caching allocator's reuse. Runs on a GPU;
// skips cleanly without one.
#include "backends/device_api.h"

#include <gtest/gtest.h>

#include "common/compare.h"
#include "ops/ops.h"

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

// A freed small block comes back only after 16 further releases (device_api.cu: the cooldown that keeps an op's
// freed workspaces away from the next op's buffers, launch.cuh "two back"); a large block comes back at once.
TEST_F(DeviceApi, CachingAllocatorReusesFreedBlocks) {
  const auto before = device::cuda_memory_stats();
  void* first = nullptr;
  {
    Tensor a = device::empty(Device::kCuda, DType::kF32, {1000});
    first = a.data();
    EXPECT_GT(device::cuda_memory_stats().first, before.first);
  }
  Tensor b = device::empty(Device::kCuda, DType::kF32, {1000});
  EXPECT_NE(b.data(), first);  // still cooling down
  for (int i = 0; i < 16; ++i) device::empty(Device::kCuda, DType::kI32, {7});  // 16 releases of another size
  Tensor c = device::empty(Device::kCuda, DType::kF32, {1000});
  EXPECT_TRUE(c.data() == first) << "the first block is reusable after 16 further releases";
  void* big = nullptr;
  {
    Tensor d = device::empty(Device::kCuda, DType::kF32, {1 << 20});  // 4 MiB: no cooldown
    big = d.data();
  }
  Tensor e = device::empty(Device::kCuda, DType::kF32, {1 << 20});
  EXPECT_EQ(e.data(), big);
}

// What the engine's CUDA-graph decode relies on: a captured graph replays with new inputs copied into its fixed
// input buffer; its temporaries come from the private pool, which never hands them to ordinary allocations.
TEST_F(DeviceApi, GraphCapturedWithPoolReplaysWithNewInputs) {
  const device::Stream stream = device::Stream::create();
  const ops::Context ctx{Device::kCuda, stream.get()};
  test::Rng rng = test::Rng::for_test();
  const Tensor in = device::empty(Device::kCuda, DType::kF32, {3, 129});  // fixed input address
  const Tensor in_host = device::empty_pinned(DType::kF32, {3, 129});
  device::AllocPool pool;
  Tensor out;
  void* temp_block = nullptr;
  device::Graph graph;
  {
    const device::ScopedAllocPool scope(pool);
    graph = device::Graph::capture(ctx.stream, [&] {
      Tensor twice = device::empty(Device::kCuda, DType::kF32, in.shape());  // a temporary, freed to the pool
      temp_block = twice.data();
      ops::add(ctx, twice, in, in);
      out = device::empty(Device::kCuda, DType::kF32, in.shape());
      ops::add(ctx, out, twice, in);  // 3 * in
    });
  }
  EXPECT_TRUE(static_cast<bool>(graph));
  EXPECT_GT(pool.bytes(), 0u);
  // An ordinary allocation of the same size must not receive the graph's freed temporary.
  const Tensor other = device::empty(Device::kCuda, DType::kF32, in.shape());
  EXPECT_NE(other.data(), temp_block);
  for (int rep = 0; rep < 3; ++rep) {
    const Tensor x = rng.normal_tensor({3, 129});
    std::copy(x.f32(), x.f32() + x.numel(), in_host.f32());
    device::copy_async(in, in_host, ctx.stream);
    graph.launch(ctx.stream);
    stream.synchronize();
    const Tensor got = device::to_host_f32(out);
    Tensor want = x.clone();
    for (int64_t i = 0; i < want.numel(); ++i) want.f32()[i] = 3.0f * x.f32()[i];
    EXPECT_ALL_CLOSE(got, want, test::kF32Elementwise);
  }
}

TEST(DeviceApiNoGpu, DescribesTheDevice) { EXPECT_FALSE(device::describe_cuda().empty()); }

}  // namespace
}  // namespace chimera
