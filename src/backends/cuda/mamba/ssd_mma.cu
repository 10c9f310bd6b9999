// Tensor-core SSD stages 3 (chunk_state) and 5 (chunk_scan) for bf16 / f16 activations at the Nemotron shape
// (head_dim P = 64, ssm_state_size N = 128, chunk 128): mma.sync m16n8k16 with fp32 accumulation, operands
// read from shared memory with ldmatrix (.trans where the operand's k runs down the stored rows), chunk
// tiles fetched with cp.async into a double buffer so the next chunk loads while this one computes.
// Portable across sm_80+, built here for sm_90a. wgmma is the next step (seed: tuned-chunk-scan section).
//
// One block of 8 warps per (superchunk, head); grid order puts the heads of one superchunk next to each other
// so the B / C tiles they share stay in L2. Shared-memory tiles keep the global layout (rows = tokens),
// padded by 8 elements per row so ldmatrix row addresses fall in distinct bank groups:
//   xs [Q, P + 8]   x rows of this head           (A^T of the state update, B of Y_diag)
//   bs [Q, N + 8]   B rows of this head's group   (B of C.B^T, B of the state update)
//   cs [Q, N + 8]   C rows                        (A of C.B^T and of Y_off)           (scan only)
//   sb [P, N + 8]   the entering state in bf16    (B of Y_off)                        (scan only)
// Rounding follows mamba_ssm: the decay/dt-weighted C.B tile, the dt-weighted x and the entering state are
// rounded to the activation type before their matrix products; everything accumulates in fp32.
#include <cstdint>

#include "backends/cuda/mamba/ssd_kernels.cuh"

namespace chimera::cuda {
namespace {

constexpr int kQ = kSsdMmaChunk;
constexpr int kP = kSsdMmaHeadDim;
constexpr int kN = kSsdMmaStateSize;
constexpr int kThreads = 256;  // 8 warps
constexpr int kXStride = kP + 8;
constexpr int kBStride = kN + 8;
static_assert(kQ == 128 && kP == 64 && kN == 128, "the warp tiling below assumes Q = 128, P = 64, N = 128");
static_assert(kThreads == 2 * kQ, "dt / dA_cumsum rows are fetched one per thread");

// ---- PTX wrappers --------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// d += a (16x16, row) * b (16x8, col); fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats <-> one register of two 16-bit values (lo in the low half, as the mma fragments expect).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t u) {
  __nv_bfloat162 v;
  memcpy(&v, &u, 4);
  return __bfloat1622float2(v);
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t u) {
  __half2 v;
  memcpy(&v, &u, 4);
  return __half22float2(v);
}

// ---- shared memory ---------------------------------------------------------------------------------
// One chunk's tiles; kWithC adds C (the scan needs it, the state pass does not).
template <typename T, bool kWithC>
struct ChunkTiles {
  T xs[kQ * kXStride];
  T bs[kQ * kBStride];
  T cs[kWithC ? kQ * kBStride : 8];
  float dt[kQ];
  float acs[kQ];  // dA_cumsum; rows past the chunk's end are zero-filled (finite, and dt = 0 there)
};
template <typename T>
struct StateSmem {
  ChunkTiles<T, false> stage[2];
};
template <typename T>
struct ScanSmem {
  ChunkTiles<T, true> stage[2];
  T sb[kP * kBStride];
};

// Issues the cp.async copies of chunk rows [begin, begin + len) of head h (group g) into `t`; rows past len
// are zero-filled. Every thread issues its share; the caller commits.
template <typename T, bool kWithC>
__device__ __forceinline__ void load_chunk(ChunkTiles<T, kWithC>& t, const SsdParams& p, int begin, int len, int h,
                                           int g) {
  const int tid = threadIdx.x;
  const T* x = static_cast<const T*>(p.x);
  const T* B = static_cast<const T*>(p.B);
#pragma unroll
  for (int i = 0; i < kQ * kP / 8 / kThreads; ++i) {
    const int idx = tid + i * kThreads, r = idx / (kP / 8), v = idx % (kP / 8);
    const bool ok = r < len;
    const T* src = ok ? x + (static_cast<size_t>(begin + r) * p.H + h) * kP + v * 8 : x;
    cp_async16(&t.xs[r * kXStride + v * 8], src, ok);
  }
#pragma unroll
  for (int i = 0; i < kQ * kN / 8 / kThreads; ++i) {
    const int idx = tid + i * kThreads, r = idx / (kN / 8), v = idx % (kN / 8);
    const bool ok = r < len;
    const size_t o = (static_cast<size_t>(begin + r) * p.G + g) * kN + v * 8;
    cp_async16(&t.bs[r * kBStride + v * 8], ok ? B + o : B, ok);
    if constexpr (kWithC) {
      const T* C = static_cast<const T*>(p.C);
      cp_async16(&t.cs[r * kBStride + v * 8], ok ? C + o : C, ok);
    }
  }
  const int r = tid % kQ;
  const bool ok = r < len;
  const float* src = tid < kQ ? p.dt : p.dA_cumsum;
  float* dst = tid < kQ ? t.dt : t.acs;
  cp_async4(&dst[r], ok ? src + static_cast<size_t>(h) * p.T + begin + r : src, ok);
}

// Lane roles in the fragments (PTX ISA, mma.m16n8k16 and ldmatrix):
//   gid = lane / 4, t4 = lane % 4: accumulator (row gid | gid + 8, cols 2 t4, 2 t4 + 1)
//   ldmatrix x4: lane supplies row (lane % 8) of matrix (lane / 8).
struct Lane {
  int lane, gid, t4, mrow, mat;
  __device__ explicit Lane(int l) : lane(l), gid(l >> 2), t4(l & 3), mrow(l & 7), mat(l >> 3) {}
};

// The state step over one chunk, this warp's part of S [P, N]: rows p in [p0, p0 + 16), columns n in
// [n0, n0 + 64) (8 accumulator tiles): S = exp(Acum[last]) * S + (x * w)^T B over the chunk's rows s, with
// w[s] = exp(Acum[last] - Acum[s]) * dt[s] applied to the x fragment (rounded to T) before the product.
template <typename T, bool kWithC>
__device__ __forceinline__ void state_step(float (&st)[8][4], const ChunkTiles<T, kWithC>& t, int len, int p0,
                                           int n0, const Lane& ln) {
  const float a_last = t.acs[len - 1];
  const float dec = __expf(a_last);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) st[j][e] *= dec;
  }
#pragma unroll
  for (int kk = 0; kk < kQ / 16; ++kk) {
    // A[m = p][k = s] = xs[s][p]: matrices (s 0-7, p 0-7), (s 0-7, p 8-15), (s 8-15, p 0-7), (s 8-15, p 8-15).
    uint32_t a[4];
    ldsm_x4_trans(a, &t.xs[(kk * 16 + ln.mrow + (ln.mat >> 1) * 8) * kXStride + p0 + (ln.mat & 1) * 8]);
    const int s0 = kk * 16 + 2 * ln.t4;
    float w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int s = s0 + (e & 1) + (e >> 1) * 8;
      w[e] = __expf(a_last - t.acs[s]) * t.dt[s];
    }
    // a[0], a[1]: k = s0, s0 + 1 (rows gid, gid + 8); a[2], a[3]: k = s0 + 8, s0 + 9.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 v = unpack2<T>(a[r]);
      const int wi = (r >> 1) * 2;
      a[r] = pack2<T>(v.x * w[wi], v.y * w[wi + 1]);
    }
#pragma unroll
    for (int jq = 0; jq < 4; ++jq) {
      // B[k = s][n] = bs[s][n]: matrices (s 0-7, n 0-7), (s 8-15, n 0-7), (s 0-7, n 8-15), (s 8-15, n 8-15).
      uint32_t b[4];
      ldsm_x4_trans(b, &t.bs[(kk * 16 + ln.mrow + (ln.mat & 1) * 8) * kBStride + n0 + jq * 16 + (ln.mat >> 1) * 8]);
      mma16816<T>(st[2 * jq], a, b[0], b[1]);
      mma16816<T>(st[2 * jq + 1], a, b[2], b[3]);
    }
  }
}

// Stage 3: the end state of each superchunk from a zero start, and its total decay.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) ssd_chunk_state_mma_kernel(SsdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<StateSmem<T>*>(smem_raw);
  const int sc = blockIdx.x / p.H, h = blockIdx.x % p.H, g = h / p.heads_per_group;
  const int2 su = p.supers[sc];
  const int warp = threadIdx.x / 32;
  const Lane ln(threadIdx.x % 32);
  const int p0 = (warp & 3) * 16, n0 = (warp >> 2) * 64;
  float st[8][4] = {};
  float decay = 1.0f;
  {
    const int2 ch = p.chunks[su.x];
    load_chunk(sm.stage[0], p, ch.x, ch.y - ch.x, h, g);
    cp_async_commit();
  }
  for (int ci = 0; ci < su.y; ++ci) {
    const int2 ch = p.chunks[su.x + ci];
    const int len = ch.y - ch.x;
    if (ci + 1 < su.y) {
      const int2 nx = p.chunks[su.x + ci + 1];
      load_chunk(sm.stage[(ci + 1) & 1], p, nx.x, nx.y - nx.x, h, g);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const auto& t = sm.stage[ci & 1];
    decay *= __expf(t.acs[len - 1]);
    state_step(st, t, len, p0, n0, ln);
    __syncthreads();  // the stage is refilled two chunks later
  }
  float* out = p.states + (static_cast<size_t>(sc) * p.H + h) * (kP * kN);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pr = p0 + ln.gid + half * 8, nc = n0 + j * 8 + 2 * ln.t4;
      *reinterpret_cast<float2*>(&out[pr * kN + nc]) = make_float2(st[j][2 * half], st[j][2 * half + 1]);
    }
  }
  if (threadIdx.x == 0) p.decay[static_cast<size_t>(sc) * p.H + h] = decay;
}

// Stage 5: y for every chunk of the superchunk, carrying the state chunk to chunk. Warp w computes the output
// rows l in [16 w, 16 w + 16) of each chunk:
//   Y_off  = exp(Acum[l]) * C[l] . S_in^T                   (k = N, S_in rounded to T in sb)
//   Y_diag = sum_{s <= l} (C[l] . B[s]) exp(Acum[l] - Acum[s]) dt[s] x[s]   (C.B^T tile j by tile j, its
//            accumulators re-packed in registers as the A fragment of the product with x; tiles past the
//            diagonal skipped)
//   y      = Y_off + Y_diag + D x
// then advances its share of the state (as stage 3) unless this is the superchunk's last chunk.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) ssd_chunk_scan_mma_kernel(SsdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<ScanSmem<T>*>(smem_raw);
  const int sc = blockIdx.x / p.H, h = blockIdx.x % p.H, g = h / p.heads_per_group;
  const int2 su = p.supers[sc];
  const int warp = threadIdx.x / 32;
  const Lane ln(threadIdx.x % 32);
  const int p0 = (warp & 3) * 16, n0 = (warp >> 2) * 64;
  float st[8][4];
  {
    const float* s_in = p.states + (static_cast<size_t>(sc) * p.H + h) * (kP * kN);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int pr = p0 + ln.gid + half * 8, nc = n0 + j * 8 + 2 * ln.t4;
        const float2 v = *reinterpret_cast<const float2*>(&s_in[pr * kN + nc]);
        st[j][2 * half] = v.x;
        st[j][2 * half + 1] = v.y;
      }
    }
  }
  const float d_skip = p.D[h];
  T* y = static_cast<T*>(p.y);
  {
    const int2 ch = p.chunks[su.x];
    load_chunk(sm.stage[0], p, ch.x, ch.y - ch.x, h, g);
    cp_async_commit();
  }
  const int m0 = warp * 16;  // this warp's output rows
  const int l0 = m0 + ln.gid, l1 = l0 + 8;
  for (int ci = 0; ci < su.y; ++ci) {
    const int2 ch = p.chunks[su.x + ci];
    const int len = ch.y - ch.x;
    if (ci + 1 < su.y) {
      const int2 nx = p.chunks[su.x + ci + 1];
      load_chunk(sm.stage[(ci + 1) & 1], p, nx.x, nx.y - nx.x, h, g);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    // The entering state, rounded to T, as the B operand of Y_off.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int pr = p0 + ln.gid + half * 8, nc = n0 + j * 8 + 2 * ln.t4;
        *reinterpret_cast<uint32_t*>(&sm.sb[pr * kBStride + nc]) = pack2<T>(st[j][2 * half], st[j][2 * half + 1]);
      }
    }
    __syncthreads();
    const auto& t = sm.stage[ci & 1];

    float acc[8][4] = {};
    // Y_off: A = C rows (k = n), B[k = n][col = p] = sb[p][n] (non-transposed ldmatrix).
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4];
      ldsm_x4(a, &t.cs[(m0 + (ln.lane & 15)) * kBStride + kk * 16 + (ln.lane >> 4) * 8]);
#pragma unroll
      for (int np = 0; np < kP / 16; ++np) {
        uint32_t b[4];
        ldsm_x4(b, &sm.sb[(np * 16 + ln.mrow + (ln.mat >> 1) * 8) * kBStride + kk * 16 + (ln.mat & 1) * 8]);
        mma16816<T>(acc[2 * np], a, b[0], b[1]);
        mma16816<T>(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    const float al0 = t.acs[l0], al1 = t.acs[l1];
    {
      const float e0 = __expf(al0), e1 = __expf(al1);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[j][0] *= e0;
        acc[j][1] *= e0;
        acc[j][2] *= e1;
        acc[j][3] *= e1;
      }
    }
    // Y_diag over the column tiles s in [16 j, 16 j + 16), j <= warp.
    for (int j = 0; j <= warp; ++j) {
      float cb[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t a[4], b[4];
        ldsm_x4(a, &t.cs[(m0 + (ln.lane & 15)) * kBStride + kk * 16 + (ln.lane >> 4) * 8]);
        // B[k = n][col = s] = bs[s][n]: matrices (s 0-7, n 0-7), (s 0-7, n 8-15), (s 8-15, n 0-7), (s 8-15, n 8-15).
        ldsm_x4(b, &t.bs[(j * 16 + ln.mrow + (ln.mat >> 1) * 8) * kBStride + kk * 16 + (ln.mat & 1) * 8]);
        mma16816<T>(cb[0], a, b[0], b[1]);
        mma16816<T>(cb[1], a, b[2], b[3]);
      }
      // cb[nt]: rows l0 (e 0, 1) and l1 (e 2, 3), columns s = 16 j + 8 nt + 2 t4 (+1).
      uint32_t af[4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int s = j * 16 + nt * 8 + 2 * ln.t4;
        const float as0 = t.acs[s], as1 = t.acs[s + 1], d0 = t.dt[s], d1 = t.dt[s + 1];
        const float v00 = s <= l0 ? cb[nt][0] * __expf(al0 - as0) * d0 : 0.0f;
        const float v01 = s + 1 <= l0 ? cb[nt][1] * __expf(al0 - as1) * d1 : 0.0f;
        const float v10 = s <= l1 ? cb[nt][2] * __expf(al1 - as0) * d0 : 0.0f;
        const float v11 = s + 1 <= l1 ? cb[nt][3] * __expf(al1 - as1) * d1 : 0.0f;
        // A fragment (rows l, k = s): {row gid, k 0-7}, {row gid + 8, k 0-7}, {row gid, k 8-15}, {gid + 8, 8-15}.
        af[2 * nt] = pack2<T>(v00, v01);
        af[2 * nt + 1] = pack2<T>(v10, v11);
      }
#pragma unroll
      for (int np = 0; np < kP / 16; ++np) {
        // B[k = s][col = p] = xs[s][p]: matrices (s 0-7, p 0-7), (s 8-15, p 0-7), (s 0-7, p 8-15), (s 8-15, p 8-15).
        uint32_t b[4];
        ldsm_x4_trans(b, &t.xs[(j * 16 + ln.mrow + (ln.mat & 1) * 8) * kXStride + np * 16 + (ln.mat >> 1) * 8]);
        mma16816<T>(acc[2 * np], af, b[0], b[1]);
        mma16816<T>(acc[2 * np + 1], af, b[2], b[3]);
      }
    }
    // + D x, stored as T.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int pc = j * 8 + 2 * ln.t4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int l = half ? l1 : l0;
        if (l < len) {
          const float2 xv = unpack2<T>(*reinterpret_cast<const uint32_t*>(&t.xs[l * kXStride + pc]));
          const uint32_t out =
              pack2<T>(acc[j][2 * half] + d_skip * xv.x, acc[j][2 * half + 1] + d_skip * xv.y);
          *reinterpret_cast<uint32_t*>(&y[(static_cast<size_t>(ch.x + l) * p.H + h) * kP + pc]) = out;
        }
      }
    }
    if (ci + 1 < su.y) state_step(st, t, len, p0, n0, ln);
    __syncthreads();  // sb and this stage are rewritten next
  }
}

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes, const char* op) {
  CHIMERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)),
                     op);
}

}  // namespace

template <typename T>
void launch_ssd_chunk_state_mma(const SsdParams& p, cudaStream_t stream) {
  constexpr size_t smem = sizeof(StateSmem<T>);
  set_smem(ssd_chunk_state_mma_kernel<T>, smem, "ops::ssd_chunk_scan (chunk_state mma)");
  ssd_chunk_state_mma_kernel<T>
      <<<static_cast<unsigned>(p.n_supers) * static_cast<unsigned>(p.H), kThreads, smem, stream>>>(p);
  CHIMERA_LAUNCH_CHECK("ops::ssd_chunk_scan (chunk_state mma)");
}

template <typename T>
void launch_ssd_chunk_scan_mma(const SsdParams& p, cudaStream_t stream) {
  constexpr size_t smem = sizeof(ScanSmem<T>);
  set_smem(ssd_chunk_scan_mma_kernel<T>, smem, "ops::ssd_chunk_scan (chunk_scan mma)");
  ssd_chunk_scan_mma_kernel<T>
      <<<static_cast<unsigned>(p.n_supers) * static_cast<unsigned>(p.H), kThreads, smem, stream>>>(p);
  CHIMERA_LAUNCH_CHECK("ops::ssd_chunk_scan (chunk_scan mma)");
}

template void launch_ssd_chunk_state_mma<__nv_bfloat16>(const SsdParams&, cudaStream_t);
template void launch_ssd_chunk_state_mma<__half>(const SsdParams&, cudaStream_t);
template void launch_ssd_chunk_scan_mma<__nv_bfloat16>(const SsdParams&, cudaStream_t);
template void launch_ssd_chunk_scan_mma<__half>(const SsdParams&, cudaStream_t);

}  // namespace chimera::cuda
