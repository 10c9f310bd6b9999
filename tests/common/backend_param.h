// One test body per backend (docs/style.md 6): op tests derive from BackendTest and are instantiated with
// CHIMERA_INSTANTIATE_BACKENDS(Suite), giving "Suite.Test/Cpu" and "Suite.Test/Cuda". The CUDA instance skips
// cleanly when the build has no CUDA backend or the machine has no GPU (CI); otherwise ctx() hands the ops a
// CUDA context, on_backend() moves host inputs there and to_host_f32() brings results back for comparison.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "backends/device_api.h"
#include "ops/ops.h"

namespace chimera::test {

class BackendTest : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override {
    if (GetParam() == Device::kCuda && !device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  }
  ops::Context ctx() const { return ops::Context{GetParam(), nullptr}; }
  bool on_cuda() const { return GetParam() == Device::kCuda; }
  // A copy of a host tensor on the backend under test, converted to `dtype` (default: unchanged).
  Tensor on_backend(const Tensor& host) const { return device::to_device(host, GetParam()); }
  Tensor on_backend(const Tensor& host, DType dtype) const { return device::to_device(host, GetParam(), dtype); }
  // An uninitialised output on the backend under test, poisoned (NaN / 0xff) so unwritten elements show.
  Tensor output(DType dtype, Shape shape) const {
    Tensor t = device::empty(GetParam(), dtype, std::move(shape));
    Tensor poison = Tensor::empty(dtype, t.shape());
    std::memset(poison.data(), 0xff, poison.nbytes());
    device::copy(t, poison);
    return t;
  }
  static Tensor host_f32(const Tensor& t) { return device::to_host_f32(t); }
};

inline std::string backend_name(const ::testing::TestParamInfo<Device>& info) {
  return info.param == Device::kCpu ? "Cpu" : "Cuda";
}

#define CHIMERA_INSTANTIATE_BACKENDS(Suite)                                                               \
  INSTANTIATE_TEST_SUITE_P(, Suite, ::testing::Values(::chimera::Device::kCpu, ::chimera::Device::kCuda), \
                           ::chimera::test::backend_name)

// A host copy of an F32 tensor converted to `dtype` (weights in BF16 / F16 for the ops under test).
inline Tensor cast_to(const Tensor& f32, DType dtype) {
  if (dtype == DType::kF32) return f32.clone();
  Tensor t = Tensor::empty(dtype, f32.shape());
  convert_from_f32(f32.f32(), dtype, t.data(), static_cast<size_t>(f32.numel()));
  return t;
}

// Runs fn and checks it throws chimera::Error of `kind` whose message contains `needle`.
template <typename Fn>
::testing::AssertionResult throws_error(Fn&& fn, ErrorKind kind, const std::string& needle) {
  try {
    std::forward<Fn>(fn)();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (e.kind() != kind) return ::testing::AssertionFailure() << "wrong error kind: " << msg;
    if (msg.find(needle) == std::string::npos) {
      return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << needle << "\"";
    }
    return ::testing::AssertionSuccess() << msg;
  }
  return ::testing::AssertionFailure() << "no exception (expected one containing \"" << needle << "\")";
}

}  // namespace chimera::test
