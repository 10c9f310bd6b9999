// Tensor: a dtype, a shape and a pointer into shared storage. Always contiguous (row-major).
// Views (reshape, rows, select) share the storage; the storage lives as long as any view of it, which is
// how memory-mapped checkpoint tensors stay valid after the file object goes away.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace chimera {

enum class Device : uint8_t { kCpu, kCuda };

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
int64_t shape_numel(const Shape& s);

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised host tensor (CPU). Device tensors come from the CUDA backend's allocator.
  static Tensor empty(DType dtype, Shape shape);
  static Tensor zeros(DType dtype, Shape shape);
  // Host fp32 / int32 tensors filled from values (tests, small tables).
  static Tensor from_f32(Shape shape, std::span<const float> values);
  static Tensor from_i32(Shape shape, std::span<const int32_t> values);
  // Wraps memory owned by someone else; `owner` keeps it alive (e.g. an mmap of a checkpoint).
  static Tensor wrap(void* data, DType dtype, Shape shape, std::shared_ptr<void> owner,
                     Device device = Device::kCpu);

  bool defined() const { return data_ != nullptr || numel() == 0; }
  explicit operator bool() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const;  // negative i counts from the back
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  float* f32() const;       // checks dtype == F32
  int32_t* i32() const;     // checks dtype == I32

  Tensor reshape(Shape shape) const;            // same numel; one dim may be -1
  Tensor rows(int64_t begin, int64_t end) const;  // [begin, end) along dim 0
  Tensor select(int64_t i) const;               // index along dim 0, drops it
  Tensor clone() const;                         // deep copy (host)
  Tensor to_f32() const;                        // host copy converted to fp32
  void fill_f32(float v) const;                 // F32 only

  std::string describe() const;  // "BF16[4096, 128]"

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
  Shape shape_;
};

}  // namespace chimera
