// dist::DeviceGroup (src/dist/device_group.h): the device collectives the model's CUDA ranks on distinct GPUs call.
// Two ranks on GPUs 0 and 1, each from its own thread with its GPU current and its own stream, against a host
// reference: all_reduce (in place), all_reduce_add_rms_norm (the row-parallel epilogue) and all_gather, in fp32
// and bf16, at a decode size and a prefill size; both ranks must hold the same bits. Skips below two GPUs or
// without NCCL.
#include <gtest/gtest.h>

#if defined(CHIMERA_HAVE_NCCL)

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backends/device_api.h"
#include "common/backend_param.h"
#include "core/counter_rng.h"
#include "core/error.h"
#include "dist/device_group.h"

namespace chimera::dist {
namespace {

constexpr int kRanks = 2;

// Host values of rank r's input, rounded to `dtype` so the reference adds what the GPUs add.
Tensor rank_input(int r, int64_t T, int64_t D, DType dtype, uint64_t salt) {
  Tensor t = Tensor::empty(DType::kF32, {T, D});
  for (int64_t i = 0; i < T * D; ++i) {
    t.f32()[i] = static_cast<float>(
        counter_uniform(salt, static_cast<uint64_t>(r) * (1u << 30) + static_cast<uint64_t>(i)) * 2 - 1);
  }
  return device::to_host_f32(test::cast_to(t, dtype));
}

// fn(rank, its stream) on one thread per rank with GPU `rank` current; waits for both streams.
void on_ranks(const std::function<void(int, void*)>& fn) {
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        device::set_current_device(r);
        const device::Stream s = device::Stream::create();
        fn(r, s.get());
        s.synchronize();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

double max_rel_err(const Tensor& got, const Tensor& want) {
  double worst = 0, scale = 1e-30;
  for (int64_t i = 0; i < want.numel(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(got.f32()[i]) - want.f32()[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(want.f32()[i])));
  }
  return worst / scale;
}

class DeviceGroupTest : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {
 protected:
  void SetUp() override {
    if (device::device_count() < kRanks) GTEST_SKIP() << "needs 2 GPUs, the machine has " << device::device_count();
    group_ = std::make_unique<DeviceGroup>(std::vector<int>{0, 1});
  }
  std::unique_ptr<DeviceGroup> group_;
};

TEST_P(DeviceGroupTest, SumsNormsAndGathersAsTheHostReference) {
  const auto [dtype, T] = GetParam();
  const int64_t D = 2688;
  const double bound = dtype == DType::kF32 ? 1e-6 : 1e-2;
  std::vector<Tensor> x(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    x[static_cast<size_t>(r)] = rank_input(r, T, D, dtype, 1);
  }
  const Tensor residual = rank_input(7, T, D, dtype, 2);  // the same on both ranks
  Tensor weight = Tensor::empty(DType::kF32, {D});
  for (int64_t i = 0; i < D; ++i) weight.f32()[i] = 1.0f + 0.1f * std::sin(static_cast<float>(i));
  weight = device::to_host_f32(test::cast_to(weight, dtype));
  const float eps = 1e-5f;

  // Host reference: the sum, then residual + sum and its RMSNorm.
  Tensor sum = Tensor::empty(DType::kF32, {T, D}), res_out = Tensor::empty(DType::kF32, {T, D}),
         norm = Tensor::empty(DType::kF32, {T, D});
  for (int64_t i = 0; i < T * D; ++i) {
    sum.f32()[i] = x[0].f32()[i] + x[1].f32()[i];
    res_out.f32()[i] = residual.f32()[i] + sum.f32()[i];
  }
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(res_out.f32()[t * D + i]) * res_out.f32()[t * D + i];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
    for (int64_t i = 0; i < D; ++i)
      norm.f32()[t * D + i] = static_cast<float>(res_out.f32()[t * D + i] * inv) * weight.f32()[i];
  }

  std::vector<Tensor> got_sum(kRanks), got_res(kRanks), got_norm(kRanks), got_gather(kRanks);
  on_ranks([&](int r, void* stream) {
    const auto ri = static_cast<size_t>(r);
    const Tensor xs = device::to_device(x[ri], Device::kCuda, dtype);
    group_->all_reduce(r, xs, stream);
    const Tensor xr = device::to_device(x[ri], Device::kCuda, dtype);
    const Tensor res = device::to_device(residual, Device::kCuda, dtype);
    const Tensor out = device::empty(Device::kCuda, dtype, {T, D});
    const Tensor w = device::to_device(weight, Device::kCuda, dtype);
    group_->all_reduce_add_rms_norm(r, res, out, xr, w, eps, stream);
    const Tensor gathered = device::empty(Device::kCuda, dtype, {kRanks, T, D});
    group_->all_gather(r, device::to_device(x[ri], Device::kCuda, dtype), gathered, stream);
    device::synchronize_stream(stream);
    got_sum[ri] = device::to_host_f32(xs);
    got_res[ri] = device::to_host_f32(res);
    got_norm[ri] = device::to_host_f32(out);
    got_gather[ri] = device::to_host_f32(gathered);
  });
  if (HasFailure()) return;
  EXPECT_LE(max_rel_err(got_sum[0], sum), bound);
  EXPECT_LE(max_rel_err(got_res[0], res_out), bound);
  EXPECT_LE(max_rel_err(got_norm[0], norm), bound * 4);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(std::memcmp(got_gather[0].f32() + r * T * D, x[static_cast<size_t>(r)].f32(), T * D * sizeof(float)), 0)
        << "gathered block " << r;
  }
  for (const auto* outs : {&got_sum, &got_res, &got_norm, &got_gather}) {
    EXPECT_EQ(std::memcmp((*outs)[0].data(), (*outs)[1].data(), (*outs)[0].nbytes()), 0) << "the ranks differ";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, DeviceGroupTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(int64_t{1}, int64_t{7}, int64_t{1024})),
                         [](const auto& i) {
                           return std::string(std::get<0>(i.param) == DType::kF32 ? "F32" : "BF16") + "_T" +
                                  std::to_string(std::get<1>(i.param));
                         });

TEST(DeviceGroup, TwoRanksOnOneGpuAreRefused) {
  if (device::device_count() < 1) GTEST_SKIP() << device::describe_cuda();
  EXPECT_THROW(DeviceGroup(std::vector<int>{0, 0}), Error);
  EXPECT_THROW(DeviceGroup(std::vector<int>{0}), Error);
}

}  // namespace
}  // namespace chimera::dist

#else

TEST(DeviceGroup, Skipped) {
  GTEST_SKIP() << "built without CUDA + NCCL";
}

#endif
