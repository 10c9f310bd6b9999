// relu(v)^2 as a CUTLASS epilogue compute functor (fusion::Sm90Compute<Relu2, ElementOut, float, ...>), shared by the
// bf16 and FP8 grouped GEMMs' up-projection epilogues: fmaxf, then the square, in fp32; the rounding to the output
// type is the epilogue's own conversion (round to nearest even, as __float2bfloat16_rn). Included by the CUTLASS
// translation units only.
#pragma once

#include <cutlass/array.h>
#include <cutlass/cutlass.h>

namespace chimera::cuda::moe {

template <class T>
struct Relu2 {
  CUTLASS_HOST_DEVICE T operator()(T const& v) const {
    const T r = v > T(0) ? v : T(0);
    return r * r;
  }
};
template <int N>
struct Relu2<cutlass::Array<float, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& v) const {
    cutlass::Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      const float r = fmaxf(v[i], 0.0f);
      out[i] = r * r;
    }
    return out;
  }
};

}  // namespace chimera::cuda::moe
