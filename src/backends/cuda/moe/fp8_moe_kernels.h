// FP8 MoE expert kernels (fp8_grouped_gemv.cu: the general and the persistent GEMV; cutlass/fp8_grouped_gemm_sm90.cu)
// and their params structs; the Tensor adapter is fp8_experts.cu. Plain pointers and sizes only. Included by .cu files
// only.
//
// Rows, pairs and work items are those of moe_kernels.h (launch_moe_permute): pair = t * top_k + j, permuted row r =
// the r-th pair in expert order, work item {expert, first permuted row, rows, 0}.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace chimera::cuda::moe {

// One grouped FP8 GEMV launch: for every work item (expert e, rows r0 .. r0 + rows) and output row n of W_e [N, K]
// (e4m3, row-major, at weight + e * N * K):
//   acc    = sum_k a[r, k] * e4m3(W_e[n, k])                        fp32
//   v      = acc * (w_scale[e] * (in_scale ? in_scale[e] : 1))
//   up   : a[r, :] = x[token(r), :] (in_scale == nullptr) or the e4m3 codes of x[token(r), :] / in_scale[e]
//          (saturated, division rounded to nearest); r' = round_act(relu(v)^2), stored at h[r, n] as the e4m3 code
//          of r' / out_scale[e] (saturated; h U8 [P, N]) with out_scale, else as the activation dtype
//   down : a[r, :] = h[r, :] (e4m3 codes with in_scale, else the activation dtype);
//          y[pair(r), n] = topk_weights[pair(r)] * v in fp32 (y [P, N], row = pair id; launch_moe_combine sums)
// The input rows of an item are staged in shared memory in the activation dtype (e4m3 values are exact in bf16,
// f16 and f32), [tile_rows][K]. Block: 8 warps x kFp8GemvRowsPerWarp weight rows; lane l reads 16-byte weight
// chunks l, l + 32, ... of each of its rows (K % 16 == 0 and a 16-byte aligned weight; otherwise single bytes).
struct Fp8GemvParams {
  const uint8_t* weight;                  // [E, N, K] e4m3
  const float* w_scale;                   // [E]
  const float* in_scale;                  // [E] or nullptr (see above)
  const float* out_scale;                 // [E] or nullptr (up only)
  const void* x;                          // up: x [T, K]; down: h [P, K]
  void* out;                              // up: h [P, N]; down: y [P, N] f32
  const int32_t* sorted_pair;             // [P]
  const int4* items;                      // [max_items]
  const int32_t* n_items;                 // [1]
  const float* topk_weights;              // [P] (down)
  int N, K, top_k, max_items, tile_rows;  // tile_rows <= kFp8GemvMaxTileRows
  bool up;
};
inline constexpr int kFp8GemvMaxTileRows = 8;
inline constexpr int kFp8GemvRowsPerWarp = 4;
inline constexpr int kFp8GemvRowsPerBlock = 8 * kFp8GemvRowsPerWarp;
inline constexpr size_t kFp8GemvMaxSmemBytes = 96 * 1024;
// The activation dtype: F32, BF16 or F16. PDL launch (cuda::launch).
void launch_moe_fp8_gemv(const Fp8GemvParams& p, DType act, cudaStream_t stream);

// The decode GEMV (fp8_grouped_gemv.cu, the persistent kernel): the same work items and output contract as
// Fp8GemvParams, with the activation scale applied while the rows are staged and h always in the activation dtype:
//   acc  = sum_k a[r, k] * e4m3(W_e[n, k]) in fp32, v = acc * w_scale[e] * s (s = 1 for kNone)
//   a    = the input rows (up: x[token(r), :]; down: h[r, :]) or, W8A8, the e4m3 values of row / s, where s is
//          in_scale[e] (kStatic) or the per-tensor dynamic scale (kDynamic: up: max |x| / 448 over x [T, K],
//          reduced by every block; down: max r / 448 over every routed r, from the up launch's per-block maxima)
//   up   : h[r, n] = round_act(relu(v)^2); with amax_out, block b also writes the max of the h it stored to
//          amax_out[b] (every block of the grid writes its slot, 0 when it stored nothing)
//   down : y[pair(r), n] = topk_weights[pair(r)] * v in fp32
// A persistent grid (fp8_persistent_gemv_grid blocks, 2 per SM) walks units of 16 weight rows of one item's expert;
// each warp owns 2 rows; the next unit's first weight loads are issued while this one finishes, so the weight stream
// never stops at a unit boundary. BF16 / F16 activations, K % 16 == 0, 16-byte aligned weights and rows,
// tile_rows x K x 2 <= kFp8GemvMaxSmemBytes.
enum class Fp8GemvAct : int { kNone, kStatic, kDynamic };
struct Fp8PersistentGemvParams {
  const uint8_t* weight;       // [E, N, K] e4m3
  const float* w_scale;        // [E]
  const float* in_scale;       // [E] (kStatic)
  Fp8GemvAct act;              // how the input rows are quantized
  const void* x;               // up: x [T, K]; down: h [P, K]; activation dtype
  void* out;                   // up: h [P, N] activation dtype; down: y [P, N] f32
  float* amax_out;             // up: [grid] per-block maxima of h (for the down launch's dynamic scale), or nullptr
  const float* amax_in;        // down, kDynamic: the up launch's amax_out
  int amax_count;              // its length: the up launch's grid
  const int32_t* sorted_pair;  // [P]
  const int4* items;           // [max_items]
  const int32_t* n_items;      // [1]
  const float* topk_weights;   // [P] (down)
  int T;                       // up: rows of x (the dynamic scale's extent)
  int N, K, top_k, max_items, tile_rows;  // tile_rows: 1, 2, 4 or 8
  bool up;
};
// The grid of a launch with these sizes (the up launch's is the down launch's amax_count).
int fp8_persistent_gemv_grid(int N, int max_items);
void launch_moe_fp8_gemv_persistent(const Fp8PersistentGemvParams& p, DType act, cudaStream_t stream);

// ---- CUTLASS 3.x sm90 FP8 grouped GEMM (cutlass/fp8_grouped_gemm_sm90.cu, built with CHIMERA_HAVE_CUTLASS) -------
// W8A8 on both projections, bf16 activations, D and I multiples of 16, 16-byte aligned expert weights. One group
// per active expert (a permutation with tile_rows >= P), swap-AB as the bf16 CUTLASS path (moe_kernels.h,
// CutlassExpertsParams): A = W_e [N_out, K] e4m3 K-major, B = the expert's rows [rows, K] e4m3 K-major,
// D = out^T column-major. launch_moe_fp8_cutlass_up:
//   1. prepare: xq[r, :] = e4m3(x[token(r), :] / in_up[e]) (the gather quantizes with the row's expert's scale),
//      pair_row[pair(r)] = r, per-group shapes / pointers / strides and the per-group scalar pointers;
//   2. up GEMM, epilogue (EVT): hq = e4m3(bf16(relu(acc * in_up[e] * s_up[e])^2) / in_down[e]) -> hq [P, I] U8;
//      with hb set (a dynamic down scale, not known before r exists): hb = bf16(relu(acc * in_up[e] * s_up[e])^2)
//      -> hb [P, I] bf16, which the caller quantizes into hq and whose scale it writes to in_down before
// launch_moe_fp8_cutlass_down:
//   3. the down GEMM's per-group alpha = in_down[e] * s_down[e] (a small kernel, in_down final now);
//   4. down GEMM, epilogue: yp = acc * in_down[e] * s_down[e] in fp32 -> yp [P, D] permuted order, unscaled by the
//      routing weight (launch_moe_combine with pair_row applies it, as on the bf16 CUTLASS path).
// Both launches take the same params and workspace.
struct Fp8CutlassParams {
  const uint8_t* up_weight;    // [E, I, D] e4m3
  const uint8_t* down_weight;  // [E, D, I] e4m3
  const float* up_scale;       // [E] s_up
  const float* up_in_scale;    // [E] in_up
  const float* down_scale;     // [E] s_down
  const float* down_in_scale;  // [E] in_down
  const void* x;               // [T, D] bf16
  const int32_t* sorted_pair;  // [P]
  const int4* items;           // [groups]
  const int32_t* n_items;      // [1]
  int P, top_k, D, I, E;
  int groups;         // min(P, E)
  uint8_t* xq;        // [P, D] scratch
  uint8_t* hq;        // [P, I] scratch
  void* hb;           // [P, I] bf16 scratch, or nullptr: the up GEMM writes r there instead of its codes
  float* yp;          // [P, D] out, permuted order
  int32_t* pair_row;  // [P] out
};
size_t fp8_cutlass_workspace_bytes(int groups);
void launch_moe_fp8_cutlass_up(const Fp8CutlassParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);
void launch_moe_fp8_cutlass_down(const Fp8CutlassParams& p, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

}  // namespace chimera::cuda::moe
