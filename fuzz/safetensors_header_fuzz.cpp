// A whole safetensors file image: [u64 LE header length][header JSON][data]. A header that loads must describe
// tensors inside the image; every view is read end to end so ASan sees any byte outside it.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace chimera;
  // An exact-size heap copy: ASan flags any read past the image.
  std::shared_ptr<void> bytes(::operator new(size == 0 ? 1 : size), [](void* p) { ::operator delete(p); });
  if (size) std::memcpy(bytes.get(), data, size);
  fuzz::expect_clean([&] {
    const auto f = SafetensorsFile::from_memory(bytes, size, "fuzz.safetensors");
    unsigned sum = 0;
    for (const auto& name : f->names()) {
      const Tensor t = f->tensor(name);
      fuzz::require(t.nbytes() == static_cast<size_t>(t.numel()) * dtype_size(t.dtype()), "nbytes matches shape");
      const auto* p = static_cast<const unsigned char*>(t.data());
      for (size_t i = 0; i < t.nbytes(); ++i) sum += p[i];
    }
    (void)sum;
  });
  return 0;
}
