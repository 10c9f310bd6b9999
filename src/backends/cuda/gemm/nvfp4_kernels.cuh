// NVFP4 weight-only kernels (docs/nvfp4_cuda.md): the weights stay as the checkpoint stores them (U8 [N, K / 2] E2M1
// pairs, F8_E4M3 [N, K / 16] block scales, an F32 per-tensor weight_scale_2) and are decoded inside the kernels; the
// activations are not quantized. Hopper has no FP4 tensor cores, so this is the Marlin-style path: decode in
// registers (GEMV) or into a 16-bit shared-memory tile feeding mma.sync (GEMM). One set of kernels serves the dense
// layer (gemm/nvfp4_linear.cu) and the routed experts' grouped projections (moe/nvfp4_experts.cu), selected by Mode:
//   kDense  out[t, n]       = round(ws2 * sum_k x[t, k] W[n, k] + bias[n])                x [T, K], out [T, N]
//   kUp     h[r, n]         = round(relu(ws2_e * sum_k x[token(r), k] W_e[n, k])^2)      h [P, N], permuted rows
//   kDown   y[pair(r), n]   = (ws2_e * sum_k h[r, k] W_e[n, k]) * topk_weight[pair(r)]    y [P, N] f32
// where W[n, k] = e2m1(code) * e4m3(block scale) (exact in fp32, bf16 and fp16: at most 6 significant bits, and
// 2^-10 <= |W| <= 2688), ws2 the per-tensor (per-expert) weight_scale_2 applied once to the fp32 sum; the grouped
// modes take the work items of launch_moe_permute (moe_kernels.h) and round at the points of the bf16 grouped GEMM
// (grouped_gemm_mma.cu: relu(acc)^2 in fp32, one rounding to the activation dtype).
//
// E2M1 decode without a table: a code s e1 e0 m placed at bits 15 / 11..9 of an fp16 (((c & 7) << 9) |
// ((c & 8) << 12)) is exactly e2m1(c) * 2^-14 (e = 0 lands on the fp16 subnormals 0 and 2^-15), so two codes of a
// 32-bit word become one half2 with two AND / shift / OR steps, and the 2^14 goes into the block scale (a power of
// two: exact). Code 8 (-0) decodes to -0, which adds nothing.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/mma_sync.cuh"

namespace chimera::cuda::nvfp4 {

enum class Mode : int { kDense = 0, kUp = 1, kDown = 2 };

struct Params {
  const uint8_t* w = nullptr;            // packed E2M1 [(E,) N, K / 2]
  const uint8_t* ws = nullptr;           // block scales e4m3 [(E,) N, K / 16]
  int64_t w_stride = 0;                  // bytes between two experts' packed weights (grouped modes)
  int64_t s_stride = 0;                  // bytes between two experts' block scales
  float scale2 = 1.0f;                   // kDense: weight_scale_2
  const float* expert_scale2 = nullptr;  // grouped: [E] weight_scale_2 on the device
  const void* x = nullptr;               // kDense / kUp: x [T, K]; kDown: h [P, K] in permuted order
  void* out = nullptr;                   // kDense: [T, N]; kUp: h [P, N]; kDown: y [P, N] f32 (row = pair id)
  const void* bias = nullptr;            // kDense only: [N] in the activation dtype, or null
  int T = 0, N = 0, K = 0;
  // grouped modes (moe_kernels.h's permutation)
  const int32_t* sorted_pair = nullptr;
  const int4* items = nullptr;
  const int32_t* n_items = nullptr;
  const float* topk_weights = nullptr;
  int top_k = 1;
};

// The exact value of an e4m3 byte (NaN for 0x7f / 0xff).
__device__ __forceinline__ float e4m3_value(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}

// Codes j and j + 4 of an 8-code word (code i at bits 4i) as fp16 values times 2^-14: {low = code j, high = j + 4}.
__device__ __forceinline__ float2 decode_pair(uint32_t word, int j) {
  const uint32_t u = word >> (4 * j);
  const uint32_t h = ((u & 0x00070007u) << 9) | ((u & 0x00080008u) << 12);
  __half2 v;
  __builtin_memcpy(&v, &h, sizeof(v));
  return __half22float2(v);
}

// The 8 codes of a word as floats times 2^-14, in element order.
__device__ __forceinline__ void decode_word(uint32_t word, float (&f)[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 p = decode_pair(word, j);
    f[j] = p.x;
    f[j + 4] = p.y;
  }
}

inline constexpr float kDecodeScale = 16384.0f;  // 2^14: undoes decode_pair's offset

// Where the grouped modes' token row j of a work item comes from and goes to.
struct Rows {
  int expert = 0;
  int count = 0;  // valid rows of this group / item
  int first = 0;  // dense: first token; grouped: first permuted row
};

template <Mode M>
__device__ __forceinline__ int64_t x_row(const Params& p, const Rows& g, int j) {
  if constexpr (M == Mode::kUp) return p.sorted_pair[g.first + j] / p.top_k;
  return g.first + j;
}

// The epilogue of one output element: acc is the fp32 sum of x * (e2m1 * e4m3) over the row.
template <typename T, Mode M>
__device__ __forceinline__ void store_out(const Params& p, const Rows& g, int j, int n, float acc) {
  if constexpr (M == Mode::kDense) {
    float v = acc * p.scale2;
    if (p.bias != nullptr) v += to_float(static_cast<const T*>(p.bias)[n]);
    static_cast<T*>(p.out)[static_cast<int64_t>(g.first + j) * p.N + n] = from_float<T>(v);
  } else if constexpr (M == Mode::kUp) {
    const float v = fmaxf(acc * p.expert_scale2[g.expert], 0.0f);
    static_cast<T*>(p.out)[static_cast<int64_t>(g.first + j) * p.N + n] = from_float<T>(v * v);
  } else {
    const int pair = p.sorted_pair[g.first + j];
    const float v = acc * p.expert_scale2[g.expert];
    static_cast<float*>(p.out)[static_cast<int64_t>(pair) * p.N + n] = v * p.topk_weights[pair];
  }
}

// The rows of group `gid` (dense: tokens [gid * rows_per_group, ...); grouped: work item gid). False: nothing to do.
template <Mode M>
__device__ __forceinline__ bool group_rows(const Params& p, int gid, int rows_per_group, Rows& g) {
  if constexpr (M == Mode::kDense) {
    g.first = gid * rows_per_group;
    g.count = min(rows_per_group, p.T - g.first);
    g.expert = 0;
    return g.count > 0;
  } else {
    if (gid >= *p.n_items) return false;
    const int4 item = p.items[gid];
    g.expert = item.x;
    g.first = item.y;
    g.count = item.z;
    return g.count > 0;
  }
}

// ---- GEMV (decode): one warp per weight row, lanes over CB-byte chunks of the packed row ------------------------
// Block: 8 warps = 8 consecutive weight rows; grid (ceil(N / 8), token groups of MT or work items). Per chunk a lane
// loads CB bytes of codes (2 * CB elements) with one non-allocating load and the chunk's CB / 8 scale bytes, decodes
// each 16-element block in registers, forms the block's dot product with every token in fp32 (x read through L1:
// every warp of the block reads the same x) and adds it times the block scale. Then the warp butterfly and the
// epilogue. kUnroll chunks are loaded before the first is used.
inline constexpr int kGemvWarps = 8;
inline constexpr int kGemvUnroll = 4;

template <int CB>
__device__ __forceinline__ void load_codes(const uint8_t* p, uint32_t (&w)[CB / 4]) {
  if constexpr (CB == 16) {
    const uint4 v = ld_stream(reinterpret_cast<const uint4*>(p));
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  } else {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x;
    w[1] = v.y;
  }
}

template <typename T, int MT, int CB, Mode M>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(const Params p) {
  constexpr int kWords = CB / 4, kElems = 2 * CB, kBlocks = kElems / 16;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int n = static_cast<int>(blockIdx.x) * kGemvWarps + warp;
  Rows g;
  if (!group_rows<M>(p, static_cast<int>(blockIdx.y), MT, g) || n >= p.N) return;
  const uint8_t* wrow = p.w + g.expert * p.w_stride + static_cast<int64_t>(n) * (p.K / 2);
  const uint8_t* srow = p.ws + g.expert * p.s_stride + static_cast<int64_t>(n) * (p.K / 16);
  const T* x = static_cast<const T*>(p.x);
  int64_t xr[MT];
#pragma unroll
  for (int j = 0; j < MT; ++j) xr[j] = j < g.count ? x_row<M>(p, g, j) * p.K : 0;

  float acc[MT];
#pragma unroll
  for (int j = 0; j < MT; ++j) acc[j] = 0.0f;
  const int n_chunks = p.K / kElems;
  for (int c0 = lane; c0 < n_chunks; c0 += 32 * kGemvUnroll) {
    uint32_t wv[kGemvUnroll][kWords];
    uint32_t sv[kGemvUnroll];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int c = c0 + u * 32;
      if (c < n_chunks) {
        load_codes<CB>(wrow + static_cast<int64_t>(c) * CB, wv[u]);
        if constexpr (kBlocks == 2) {
          sv[u] = __ldg(reinterpret_cast<const uint16_t*>(srow) + c);
        } else {
          sv[u] = __ldg(srow + c);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      const int c = c0 + u * 32;
      if (c >= n_chunks) continue;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        const float sc = e4m3_value(static_cast<uint8_t>(sv[u] >> (8 * b))) * kDecodeScale;
        float wf[16];
        {
          float lo[8], hi[8];
          decode_word(wv[u][2 * b], lo);
          decode_word(wv[u][2 * b + 1], hi);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            wf[i] = lo[i];
            wf[8 + i] = hi[i];
          }
        }
        const int64_t k0 = static_cast<int64_t>(c) * kElems + b * 16;
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          if (j < g.count) {
            float xa[8], xb[8];
            load_f32<T, 8>(x + xr[j] + k0, xa);
            load_f32<T, 8>(x + xr[j] + k0 + 8, xb);
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) s = fmaf(wf[i], xa[i], s);
#pragma unroll
            for (int i = 0; i < 8; ++i) s = fmaf(wf[8 + i], xb[i], s);
            acc[j] = fmaf(s, sc, acc[j]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < MT; ++j) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  }
  if (lane < g.count) {
    float v = 0.0f;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      if (j == lane) v = acc[j];
    }
    store_out<T, M>(p, g, lane, n, v);
  }
}

// ---- GEMM (prefill): mma.sync m16n8k16 with the weight tile dequantized into shared memory ----------------------
// Block: 128 threads = 4 warps along N; tile BN = 128 weight rows (the MMA's A side, swap-AB as grouped_gemm_mma.cu)
// x BT = 64 tokens (B side), BK = 64. A kStages cp.async pipeline brings per stage the packed codes [BN][32 B], the
// block scales [BN][4 B] and the x tile [BT][BK] (16-bit, XOR-swizzled 16-byte chunks); then thread r decodes weight
// row r of the stage (64 codes times its 4 block scales, exact in T) into the swizzled [BN][BK] T tile that the warps
// read with ldmatrix. Two barriers per k-tile (stage ready; tile decoded). fp32 accumulators; the epilogue goes
// through shared memory (fp32 [BT][BN + 4]) so that the global stores are contiguous along n.
// Domain: T = bf16 / f16, K % 64 == 0 (whole k-tiles: the packed rows 32-byte and the scale rows 4-byte aligned).
inline constexpr int kMmaThreads = 128, kMmaBN = 128, kMmaBT = 64, kMmaBK = 64, kMmaStages = 3;

constexpr size_t mma_smem_bytes() {
  const size_t stage = static_cast<size_t>(kMmaBN) * (kMmaBK / 2) + static_cast<size_t>(kMmaBN) * (kMmaBK / 16) +
                       static_cast<size_t>(kMmaBT) * kMmaBK * 2;
  const size_t pipe = kMmaStages * stage + static_cast<size_t>(kMmaBN) * kMmaBK * 2;
  const size_t epi = static_cast<size_t>(kMmaBT) * (kMmaBN + 4) * 4;
  return pipe > epi ? pipe : epi;
}

__device__ __forceinline__ int mma_swz(int row, int chunk) {
  return row * kMmaBK + ((chunk ^ (row & 7)) << 3);
}

// 4-byte global -> shared copy through L1 (cp.async.cg takes 16 bytes only); !valid zero-fills.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

template <typename T, Mode M>
__global__ void __launch_bounds__(kMmaThreads) gemm_kernel(const Params p) {
  constexpr int BN = kMmaBN, BT = kMmaBT, BK = kMmaBK, kStages = kMmaStages;
  constexpr int WM = BN / 4, MI = WM / 16, NI = BT / 8;
  constexpr int kCodeBytes = BN * (BK / 2), kScaleBytes = BN * (BK / 16), kXElems = BT * BK;
  constexpr int kStageBytes = kCodeBytes + kScaleBytes + kXElems * 2;
  constexpr int kXChunks = kXElems / 8 / kMmaThreads;
  static_assert(BN == kMmaThreads, "one decoding thread per weight row");
  extern __shared__ __align__(128) unsigned char nvfp4_smem[];
  T* sA = reinterpret_cast<T*>(nvfp4_smem + kStages * kStageBytes);  // [BN][BK] decoded, swizzled

  Rows g;
  if (!group_rows<M>(p, static_cast<int>(blockIdx.y), BT, g)) return;
  const int n0 = static_cast<int>(blockIdx.x) * BN;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int KT = p.K / BK;
  const uint8_t* wbase = p.w + g.expert * p.w_stride;
  const uint8_t* sbase = p.ws + g.expert * p.s_stride;
  const T* X = static_cast<const T*>(p.x);

  // Loaders: codes: 2 x 16-byte chunks per row (row (tid + i * 128) / 2, half % 2); scales: row tid, 4 bytes;
  // x: chunk c = tid + i * 128 -> (row c / 8, 16-byte chunk c % 8).
  const uint8_t* c_src[2];
  bool c_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = tid + i * kMmaThreads, r = c / 2;
    c_ok[i] = n0 + r < p.N;
    c_src[i] = wbase + static_cast<int64_t>(c_ok[i] ? n0 + r : 0) * (p.K / 2) + (c % 2) * 16;
  }
  const bool s_ok = n0 + tid < p.N;
  const uint8_t* s_src = sbase + static_cast<int64_t>(s_ok ? n0 + tid : 0) * (p.K / 16);
  const int x_chunk = tid % 8;
  const T* x_src[kXChunks];
  bool x_ok[kXChunks];
#pragma unroll
  for (int i = 0; i < kXChunks; ++i) {
    const int r = (tid + i * kMmaThreads) / 8;
    x_ok[i] = r < g.count;
    x_src[i] = X + (x_ok[i] ? x_row<M>(p, g, r) : 0) * p.K + x_chunk * 8;
  }
  auto load_stage = [&](int stage, int kt) {
    unsigned char* base = nvfp4_smem + stage * kStageBytes;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kMmaThreads;
      cp_async_16(smem_addr(base + c * 16), c_src[i] + kt * (BK / 2), c_ok[i]);
    }
    cp_async_4(smem_addr(base + kCodeBytes + tid * 4), s_src + kt * (BK / 16), s_ok);
    T* dx = reinterpret_cast<T*>(base + kCodeBytes + kScaleBytes);
#pragma unroll
    for (int i = 0; i < kXChunks; ++i) {
      const int r = (tid + i * kMmaThreads) / 8;
      cp_async_16(smem_addr(dx + mma_swz(r, x_chunk)), x_src[i] + kt * BK, x_ok[i]);
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }
  const int a_row = warp * WM + lane % 16, a_khalf = lane / 16;
  const int b_row = (lane / 16) * 8 + lane % 8, b_khalf = (lane / 8) % 2;

  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; the previous tile's ldmatrix reads of sA are done
    {
      const int nk = kt + kStages - 1;
      if (nk < KT) load_stage(nk % kStages, nk);
      cp_async_commit();
    }
    const unsigned char* base = nvfp4_smem + (kt % kStages) * kStageBytes;
    {
      // Thread tid decodes weight row tid: 8 words of codes, 4 block scales.
      const uint4 q0 = reinterpret_cast<const uint4*>(base)[2 * tid];
      const uint4 q1 = reinterpret_cast<const uint4*>(base)[2 * tid + 1];
      const uint32_t sc4 = reinterpret_cast<const uint32_t*>(base + kCodeBytes)[tid];
      const uint32_t words[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
      for (int ch = 0; ch < 8; ++ch) {
        const float sc = e4m3_value(static_cast<uint8_t>(sc4 >> (8 * (ch / 2)))) * kDecodeScale;
        float f[8];
        decode_word(words[ch], f);
        alignas(16) T v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = from_float<T>(f[i] * sc);
        *reinterpret_cast<uint4*>(sA + mma_swz(tid, ch)) = *reinterpret_cast<const uint4*>(v);
      }
    }
    __syncthreads();  // sA holds the decoded tile
    const T* tx = reinterpret_cast<const T*>(base + kCodeBytes + kScaleBytes);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], smem_addr(sA + mma_swz(a_row + mi * 16, kk * 2 + a_khalf)));
#pragma unroll
      for (int nj = 0; nj < NI; nj += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(tx + mma_swz(b_row + nj * 8, kk * 2 + b_khalf)));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<T>(acc[mi][nj], a[mi], b[0], b[1]);
          mma_16816<T>(acc[mi][nj + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Accumulator (m16n8): c0, c1 at (weight row g, tokens 2q, 2q + 1), c2, c3 at row g + 8; g = lane / 4, q = lane % 4.
  constexpr int kLd = BN + 4;
  float* sOut = reinterpret_cast<float*>(nvfp4_smem);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const int n = warp * WM + mi * 16 + lane / 4, m = ni * 8 + 2 * (lane % 4);
#pragma unroll
      for (int c = 0; c < 4; ++c) sOut[(m + (c & 1)) * kLd + n + (c >> 1) * 8] = acc[mi][ni][c];
    }
  }
  __syncthreads();
  for (int c = tid; c < BT * BN; c += kMmaThreads) {
    const int m = c / BN, n = c % BN;
    if (m < g.count && n0 + n < p.N) store_out<T, M>(p, g, m, n0 + n, sOut[m * kLd + n]);
  }
}

// ---- tensor-core GEMV (decode): codes decoded straight into mma.sync A fragments ---------------------------------
// The scalar GEMV above spends ~6 SIMT instructions per weight element at T = 1 (decode, x conversion, FMA), about
// what an SM can issue per byte of HBM bandwidth; here the multiply-adds go to the tensor cores and the decode is a
// shift / AND / LOP3 per pair of codes plus one packed multiply by the block scale. Block: 8 warps on one tile of 16
// weight rows, the k-steps of 128 elements dealt round robin to the warps, then a fixed-order sum of the 8 warps'
// accumulators in shared memory. Tokens are the MMA's 8 columns (MT = 8, zero columns past the group's tokens).
//
// Lane (g = lane / 4, q = lane % 4) loads, per k-step k0, the 16 bytes of codes [k0 + 32 q, k0 + 32 q + 32) of rows
// g and g + 8, their two block scales each, and x[token g] at the same 32 elements. Within a 32-bit word of 8 codes
// the pairs (j, j + 4) become one 16-bit pair register (the top nibble of each half, moved into place: e2m1 x 2^-126
// as bf16, e2m1 x 2^-14 as fp16, subnormals for e = 0), times the block scale pre-multiplied by 2^118 (bf16) or 2^7
// (fp16) so that the product e2m1 x e4m3 x 2^-8 (2^-7) is exact and normal (fp16: a multiple of 2^-17, above its
// subnormal quantum); the result is multiplied back by 2^8 (2^7) with weight_scale_2. The k order inside an MMA is a
// permutation of the natural order (word w, pairs (0, 4) and (1, 5) feed MMA 2w, pairs (2, 6) and (3, 7) MMA
// 2w + 1), and x's registers are permuted the same way (one PRMT per register), so A and B agree element by element.
// Domain: T = bf16 / f16, K % 32 == 0.
inline constexpr int kTcWarps = 8, kTcRows = 16, kTcStepK = 128, kTcTokens = 8;

template <typename T>
struct TcDecode;
template <>
struct TcDecode<__nv_bfloat16> {
  static constexpr float kScaleUp = 0x1p118f;  // block scale x 2^118: at most 448 x 2^118 < 2^127
  static constexpr float kResult = 256.0f;     // the decoded weights are e2m1 x e4m3 x 2^-8
  __device__ static uint32_t pair(uint32_t q) { return (q & 0x80008000u) | ((q >> 6) & 0x01C001C0u); }
  __device__ static uint32_t scale_pair(float s) { return pack2<__nv_bfloat16>(s, s); }
  __device__ static uint32_t mul(uint32_t a, uint32_t b) {
    __nv_bfloat162 x, y;
    __builtin_memcpy(&x, &a, 4);
    __builtin_memcpy(&y, &b, 4);
    const __nv_bfloat162 r = __hmul2(x, y);
    uint32_t u;
    __builtin_memcpy(&u, &r, 4);
    return u;
  }
};
template <>
struct TcDecode<__half> {
  static constexpr float kScaleUp = 128.0f;  // block scale x 2^7: at most 57344
  static constexpr float kResult = 128.0f;   // the decoded weights are e2m1 x e4m3 x 2^-7
  __device__ static uint32_t pair(uint32_t q) { return (q & 0x80008000u) | ((q >> 3) & 0x0E000E00u); }
  __device__ static uint32_t scale_pair(float s) { return pack2<__half>(s, s); }
  __device__ static uint32_t mul(uint32_t a, uint32_t b) {
    __half2 x, y;
    __builtin_memcpy(&x, &a, 4);
    __builtin_memcpy(&y, &b, 4);
    const __half2 r = __hmul2(x, y);
    uint32_t u;
    __builtin_memcpy(&u, &r, 4);
    return u;
  }
};

template <typename T, Mode M>
__global__ void __launch_bounds__(kTcWarps * 32) tc_gemv_kernel(const Params p) {
  using D = TcDecode<T>;
  __shared__ float red[kTcWarps][kTcRows][kTcTokens];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int gq = lane / 4, tq = lane % 4;
  const int n0 = static_cast<int>(blockIdx.x) * kTcRows;
  Rows g;
  if (!group_rows<M>(p, static_cast<int>(blockIdx.y), kTcTokens, g)) return;  // uniform over the block
  const int K = p.K;
  const bool ok_a = n0 + gq < p.N, ok_b = n0 + gq + 8 < p.N, ok_x = gq < g.count;
  const uint8_t* wa = p.w + g.expert * p.w_stride + static_cast<int64_t>(ok_a ? n0 + gq : 0) * (K / 2);
  const uint8_t* wb = p.w + g.expert * p.w_stride + static_cast<int64_t>(ok_b ? n0 + gq + 8 : 0) * (K / 2);
  const uint8_t* sa = p.ws + g.expert * p.s_stride + static_cast<int64_t>(ok_a ? n0 + gq : 0) * (K / 16);
  const uint8_t* sb = p.ws + g.expert * p.s_stride + static_cast<int64_t>(ok_b ? n0 + gq + 8 : 0) * (K / 16);
  const T* xr = static_cast<const T*>(p.x) + (ok_x ? x_row<M>(p, g, gq) : 0) * static_cast<int64_t>(K);
  const int n_steps = (K + kTcStepK - 1) / kTcStepK;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // Codes and scales of step s for this lane (zeros past K or N).
  auto load = [&](int s, uint4& qa, uint4& qb, uint32_t& ca, uint32_t& cb) {
    const int k = s * kTcStepK + 32 * tq;
    const bool kv = s < n_steps && k < K;
    qa = kv && ok_a ? ld_stream(reinterpret_cast<const uint4*>(wa + k / 2)) : zero;
    qb = kv && ok_b ? ld_stream(reinterpret_cast<const uint4*>(wb + k / 2)) : zero;
    ca = kv && ok_a ? __ldg(reinterpret_cast<const uint16_t*>(sa + k / 16)) : 0u;
    cb = kv && ok_b ? __ldg(reinterpret_cast<const uint16_t*>(sb + k / 16)) : 0u;
  };
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  uint4 qa, qb;
  uint32_t ca, cb;
  load(warp, qa, qb, ca, cb);
  for (int s = warp; s < n_steps; s += kTcWarps) {
    uint4 na, nb;
    uint32_t nca, ncb;
    load(s + kTcWarps, na, nb, nca, ncb);  // the next step's loads in flight during this step's MMAs
    const int k = s * kTcStepK + 32 * tq;
    uint4 xv[4] = {zero, zero, zero, zero};
    if (ok_x && k < K) {
#pragma unroll
      for (int w = 0; w < 4; ++w) xv[w] = __ldg(reinterpret_cast<const uint4*>(xr + k + 8 * w));
    }
    const uint32_t scale_a[2] = {D::scale_pair(e4m3_value(static_cast<uint8_t>(ca)) * D::kScaleUp),
                                 D::scale_pair(e4m3_value(static_cast<uint8_t>(ca >> 8)) * D::kScaleUp)};
    const uint32_t scale_b[2] = {D::scale_pair(e4m3_value(static_cast<uint8_t>(cb)) * D::kScaleUp),
                                 D::scale_pair(e4m3_value(static_cast<uint8_t>(cb >> 8)) * D::kScaleUp)};
    const uint32_t wa4[4] = {qa.x, qa.y, qa.z, qa.w}, wb4[4] = {qb.x, qb.y, qb.z, qb.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      // pa[j]: codes (j, j + 4) of word w of row g; pb[j] the same of row g + 8.
      uint32_t pa[4], pb[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        pa[j] = D::mul(D::pair(wa4[w] << (4 * (3 - j))), scale_a[w / 2]);
        pb[j] = D::mul(D::pair(wb4[w] << (4 * (3 - j))), scale_b[w / 2]);
      }
      const uint32_t x01 = xv[w].x, x23 = xv[w].y, x45 = xv[w].z, x67 = xv[w].w;
      {
        const uint32_t a[4] = {pa[0], pb[0], pa[1], pb[1]};
        mma_16816<T>(acc, a, __byte_perm(x01, x45, 0x5410), __byte_perm(x01, x45, 0x7632));
      }
      {
        const uint32_t a[4] = {pa[2], pb[2], pa[3], pb[3]};
        mma_16816<T>(acc, a, __byte_perm(x23, x67, 0x5410), __byte_perm(x23, x67, 0x7632));
      }
    }
    qa = na;
    qb = nb;
    ca = nca;
    cb = ncb;
  }
  // c0, c1: (row g, tokens 2q, 2q + 1); c2, c3: (row g + 8, tokens 2q, 2q + 1).
  red[warp][gq][2 * tq] = acc[0];
  red[warp][gq][2 * tq + 1] = acc[1];
  red[warp][gq + 8][2 * tq] = acc[2];
  red[warp][gq + 8][2 * tq + 1] = acc[3];
  __syncthreads();
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < kTcRows * kTcTokens) {
    const int r = tid / kTcTokens, t = tid % kTcTokens;
    if (n0 + r < p.N && t < g.count) {
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < kTcWarps; ++w) v += red[w][r][t];
      store_out<T, M>(p, g, t, n0 + r, v * D::kResult);
    }
  }
}

// ---- launchers (host) ---------------------------------------------------------------------------------------
inline int gemv_tile_tokens(int64_t T) {
  return T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8;
}

// groups: dense ceil(T / MT) (MT = gemv_tile_tokens(T)); grouped max_items (items of <= MT rows).
template <typename T, Mode M>
void launch_gemv(const Params& p, int mt, int groups, cudaStream_t stream, const char* op) {
  if (groups <= 0 || p.N <= 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.N, kGemvWarps)), static_cast<unsigned>(groups));
  const bool wide = p.K % 32 == 0;  // 16-byte chunks (K / 2 % 16 == 0), else 8-byte chunks (one block)
  auto go = [&](auto kernel) { kernel<<<grid, kGemvWarps * 32, 0, stream>>>(p); };
  switch (mt) {
    case 1: wide ? go(gemv_kernel<T, 1, 16, M>) : go(gemv_kernel<T, 1, 8, M>); break;
    case 2: wide ? go(gemv_kernel<T, 2, 16, M>) : go(gemv_kernel<T, 2, 8, M>); break;
    case 4: wide ? go(gemv_kernel<T, 4, 16, M>) : go(gemv_kernel<T, 4, 8, M>); break;
    default: wide ? go(gemv_kernel<T, 8, 16, M>) : go(gemv_kernel<T, 8, 8, M>); break;
  }
  CHIMERA_LAUNCH_CHECK(op);
}

// groups: dense ceil(T / 8); grouped max_items (items of <= 8 rows).
template <typename T, Mode M>
void launch_tc_gemv(const Params& p, int groups, cudaStream_t stream, const char* op) {
  if (groups <= 0 || p.N <= 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.N, kTcRows)), static_cast<unsigned>(groups));
  tc_gemv_kernel<T, M><<<grid, kTcWarps * 32, 0, stream>>>(p);
  CHIMERA_LAUNCH_CHECK(op);
}

// groups: dense ceil(T / kMmaBT); grouped max_items (items of <= kMmaBT rows).
template <typename T, Mode M>
void launch_gemm(const Params& p, int groups, cudaStream_t stream, const char* op) {
  if (groups <= 0 || p.N <= 0) return;
  constexpr size_t smem = mma_smem_bytes();
  static const bool configured = [op] {
    set_max_dynamic_smem(gemm_kernel<T, M>, smem, op);
    return true;
  }();
  (void)configured;
  const dim3 grid(static_cast<unsigned>(ceil_div(p.N, kMmaBN)), static_cast<unsigned>(groups));
  gemm_kernel<T, M><<<grid, kMmaThreads, smem, stream>>>(p);
  CHIMERA_LAUNCH_CHECK(op);
}

}  // namespace chimera::cuda::nvfp4
