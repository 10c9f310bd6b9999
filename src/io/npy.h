// .npy (NumPy format version 1.0/2.0/3.0) reading and writing for little-endian F32 / I32 / I64 arrays:
// --logits-out files and the transformers fixtures. Errors are kInvalidInput naming the file.
#pragma once

#include <filesystem>

#include "core/tensor.h"

namespace chimera {

Tensor read_npy(const std::filesystem::path& path);  // '<f4' -> F32, '<i4' -> I32, '<i8' -> I64 (C order)
void write_npy(const std::filesystem::path& path, const Tensor& t);  // F32 / I32 / I64 host tensors

}  // namespace chimera
