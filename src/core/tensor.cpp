#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/parallel.h"

namespace chimera {

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  return r + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Tensor Tensor::empty(DType dtype, Shape shape) {
  for (int64_t d : shape) CHIMERA_CHECK(d >= 0, "negative dimension in {}", shape_str(shape));
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  const size_t bytes = std::max<size_t>(t.nbytes(), 1);
  // 64-byte alignment: cache lines, and safe for any vector width the CPU backend uses.
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) runtime_error("out of host memory allocating {} bytes for {}", bytes, t.describe());
  t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  t.data_ = p;
  return t;
}

Tensor Tensor::zeros(DType dtype, Shape shape) {
  Tensor t = empty(dtype, std::move(shape));
  std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::from_f32(Shape shape, std::span<const float> values) {
  Tensor t = empty(DType::kF32, std::move(shape));
  CHIMERA_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "from_f32: {} values for {}",
                values.size(), t.describe());
  std::memcpy(t.data_, values.data(), t.nbytes());
  return t;
}

Tensor Tensor::from_i32(Shape shape, std::span<const int32_t> values) {
  Tensor t = empty(DType::kI32, std::move(shape));
  CHIMERA_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "from_i32: {} values for {}",
                values.size(), t.describe());
  std::memcpy(t.data_, values.data(), t.nbytes());
  return t;
}

Tensor Tensor::wrap(void* data, DType dtype, Shape shape, std::shared_ptr<void> owner, Device device) {
  Tensor t;
  t.storage_ = owner ? std::move(owner) : std::shared_ptr<void>(data, [](void*) {});
  t.data_ = data;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.device_ = device;
  return t;
}

int64_t Tensor::dim(int i) const {
  const int n = ndim();
  if (i < 0) i += n;
  CHIMERA_CHECK(i >= 0 && i < n, "dim {} out of range for {}", i, describe());
  return shape_[static_cast<size_t>(i)];
}

float* Tensor::f32() const {
  CHIMERA_CHECK(dtype_ == DType::kF32, "expected an F32 tensor, got {}", describe());
  return static_cast<float*>(data_);
}

int32_t* Tensor::i32() const {
  CHIMERA_CHECK(dtype_ == DType::kI32, "expected an I32 tensor, got {}", describe());
  return static_cast<int32_t*>(data_);
}

Tensor Tensor::reshape(Shape shape) const {
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      CHIMERA_CHECK(infer < 0, "reshape: more than one -1 in {}", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) shape[static_cast<size_t>(infer)] = known ? numel() / known : 0;
  CHIMERA_CHECK(shape_numel(shape) == numel(), "reshape {} -> {}", describe(), shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  CHIMERA_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0], "rows({}, {}) of {}",
                begin, end, describe());
  const int64_t row = shape_[0] ? numel() / shape_[0] : 0;
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(begin * row) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::select(int64_t i) const {
  Tensor t = rows(i, i + 1);
  t.shape_.erase(t.shape_.begin());
  return t;
}

Tensor Tensor::clone() const {
  CHIMERA_CHECK(device_ == Device::kCpu, "clone of a device tensor on the host path");
  Tensor t = empty(dtype_, shape_);
  std::memcpy(t.data_, data_, nbytes());
  return t;
}

Tensor Tensor::to_f32() const {
  CHIMERA_CHECK(device_ == Device::kCpu, "to_f32 of a device tensor on the host path");
  Tensor t = empty(DType::kF32, shape_);
  // Split over the CPU backend's threads for large tensors (a --quantization load converts every weight).
  const size_t esize = dtype_size(dtype_);
  parallel_for(numel(), int64_t{1} << 18, [&](int64_t b, int64_t e) {
    convert_to_f32(static_cast<const char*>(data_) + static_cast<size_t>(b) * esize, dtype_, t.f32() + b,
                   static_cast<size_t>(e - b));
  });
  return t;
}

void Tensor::fill_f32(float v) const {
  float* p = f32();
  for (int64_t i = 0; i < numel(); ++i) p[i] = v;
}

std::string Tensor::describe() const { return std::string(dtype_name(dtype_)) + shape_str(shape_); }

}  // namespace chimera
