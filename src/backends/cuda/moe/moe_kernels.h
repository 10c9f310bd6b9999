// MoE kernel launchers (router top-k, pair permutation, grouped expert GEMMs, combine) and their params structs.
// Kernels take no framework types: plain pointers, sizes and dtype codes; the Tensor adapters live in router.cu
// and experts.cu. Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace chimera::cuda::moe {

// ---- router (router.cu) -------------------------------------------------------------------------------
struct RouterParams {
  const void* logits;       // [T, E] f32 / bf16 / f16 (logits_dtype)
  const void* bias;         // [E] correction bias, f32 / bf16 / f16 (bias_dtype)
  int32_t* topk_ids;        // [T, k]
  float* topk_weights;      // [T, k]
  int T, E, k;              // E <= 512, k <= 32
  int n_group, topk_group;  // group-limited routing when n_group > 1 (E % n_group == 0)
  bool norm_topk_prob;
  float routed_scaling_factor;
  DType logits_dtype, bias_dtype;
  // Which kernel (benchmarks compare them; the ops:: path leaves it automatic): 0 = automatic, 1 = one warp
  // per token (any n_group), 2 = one block per token (n_group == 1 only; otherwise the warp kernel runs).
  int kernel = 0;
};
void launch_router_topk(const RouterParams& p, cudaStream_t stream);

// ---- router gate + top-k in one launch (router.cu; ops::router_gate_topk at decode sizes) ------------------------
// logits[t, e] = sum_d x[t, d] * gate[e, d] in fp32, then router_topk's selection, in ONE kernel instead of three
// (x -> fp32 convert, cuBLASLt GEMM, router_topk). Grid: n_split column chunks x ceil(E / kGateWarps) expert
// groups, kGateWarps warps per block. In block (s, g) warp w takes expert g * kGateWarps + w over the columns
// s * chunk .. (s + 1) * chunk - 1, lanes strided over the chunk (16-byte gate loads when D % 4 == 0; the lane's
// gate values into registers first, then x straight from global memory, so both loads overlap), and stores the
// warp-reduced partial dot product of every token to partial[s, t, e]. The last block to finish
// (a ticket counter that wraps back to zero, so a graph replay finds it ready) sums the partials in split order
// (deterministic: the same logits on every run) into shared memory and routes the T tokens with router_topk's own
// device code: one warp per token, or the block-per-token select token after token. The logits differ from
// cuBLASLt's by fp32 summation order only.
inline constexpr int kGateMaxTokens = 16;      // the selection's one warp per token; larger T: the three-op path
inline constexpr int kGateWarps = 16;          // warps per block (512 threads: also the block-select width)
inline constexpr int kGateMaxChunk = 512;      // columns per split (a lane holds chunk / 32 gate values)
inline constexpr int kGateTargetBlocks = 132;  // about one block per H200 SM (more splits: more partials to sum)
inline constexpr size_t kGateMaxSmemBytes = 100 * 1024;
struct GateSplit {
  int n_split;  // column chunks (the partials' leading dimension)
  int chunk;    // columns per chunk, a multiple of 4
};
GateSplit gate_topk_split(int E, int D);
// T in [1, kGateMaxTokens], E <= 512, k <= min(32, E), and the shared memory of the selection fits.
bool gate_topk_supported(int T, int E, int k, int n_group, int D);
struct GateTopkParams {
  RouterParams route;  // T, E, k, groups, scaling, bias, outputs; logits / logits_dtype / kernel are unused
  const void* x;       // [T, D] x_dtype (f32 / bf16 / f16)
  const float* gate;   // [E, D] f32
  float* partial;      // [split.n_split, T, E] f32 scratch
  int D;
  GateSplit split;     // gate_topk_split(E, D)
  DType x_dtype;
  // Selection (benchmarks compare them): 0 = automatic, 1 = one warp per token (any n_group), 2 = the
  // block-per-token select, token after token (n_group == 1; otherwise the warps).
  int select = 0;
};
// The ticket counter is one of a few zero-initialised device words, one per host thread (slot = thread id mod
// 64): launches from one host thread must be stream-ordered (as ops on one stream are), two threads never share one.
void launch_router_gate_topk(const GateTopkParams& p, cudaStream_t stream);

// The same op in ONE thread-block cluster, for decode (T <= kGateClusterMaxTokens) when the fp32 gate is split over
// C CTAs (C = 16, non-portable, or 8 when 16 cannot be co-scheduled) and a CTA's slice fits its shared memory.
// Why: the kernel above has ~5 dependent global round trips after its pdl_wait (x, the partials' stores, fence +
// ticket, the partials' loads, the outputs), each slow while the next kernel (the MoE up GEMV's shared-expert units,
// started before their own wait) saturates DRAM: in the engine the router's critical path is about twice its
// stand-alone time. Here one round trip remains (x) before the outputs. CTA r owns experts [r * epc, (r + 1) * epc),
// epc = ceil(E / C), 512 threads:
//   0. before pdl_wait: the CTA's gate rows (contiguous, epc x D fp32) global -> shared with cp.async.bulk (TMA,
//      completion on an mbarrier; D % 4 == 0 and a 16-byte aligned gate, else plain loads), CTA 0 the bias (both
//      constants); nothing else, no global write;
//   1. after it: x [T, D] into shared memory in its dtype; wait for the gate; warp w takes (row, column slice) tasks
//      w, w + 16, ...: lane-strided fmaf over the slice (columns ascending), warp butterfly, then the slices summed in
//      slice order: a fixed summation order (the same logits on every run; they differ from the kernel above by
//      fp32 summation order only);
//   2. the logits go straight into CTA 0's shared memory (distributed shared memory, after a cluster barrier that
//      proves CTA 0 has started); the other CTAs arrive (release) on a second cluster barrier and exit;
//   3. CTA 0 waits on it (acquire) and routes the T tokens with the kernel above's selection (warp / block select,
//      group-limited routing included), the only global writes.
// Nano (E 128, D 2688): 8 rows x 2688 x 4 = 84 KiB of gate per CTA at C = 16. Super's router (E 512, D 4096: 8 MiB
// of fp32 gate, 512 KiB per CTA) does not fit and keeps the kernel above.
inline constexpr int kGateClusterMaxTokens = 4;
inline constexpr size_t kGateClusterMaxSmemBytes = 200 * 1024;  // dynamic shared memory per CTA
// Launches the cluster kernel when the shape takes it (gate_topk_supported's domain, T <= kGateClusterMaxTokens,
// x f32 / bf16 / f16, the CTA slice + x within kGateClusterMaxSmemBytes, a cluster of 16 or 8 that can be
// co-scheduled) and returns its cluster size; returns 0 and launches nothing otherwise. p.partial is unused.
int launch_router_gate_cluster(const GateTopkParams& p, cudaStream_t stream);

// ---- grouped expert GEMMs -----------------------------------------------------------------------------
// The (token, choice) pairs are numbered pair = t * top_k + j (P = T * top_k). The permutation orders them by
// expert (stably: increasing pair id within an expert); "permuted row" r is the r-th pair in that order.
// A work item is a tile of up to BT permuted rows of one expert: {expert, first permuted row, rows, 0}.
struct PermuteParams {
  const int32_t* topk_ids;  // [P]; ids outside [0, E) are skipped (they contribute nothing)
  int P, E, tile_rows;      // tile_rows = the GEMM's BT
  int32_t* sorted_pair;     // [P] out: pair ids in permuted order (entries past the valid pairs unused)
  int4* items;              // [max_items] out
  int32_t* n_items;         // [1] out
};
inline constexpr int kPermuteMaxExperts = 512;
void launch_moe_permute(const PermuteParams& p, cudaStream_t stream);
// ids [n] in place: id - first for an id in [first, first + count), else -1 (ops::local_expert_ids).
void launch_local_expert_ids(int32_t* ids, int64_t n, int32_t first, int32_t count, cudaStream_t stream);

// One grouped GEMM: for every work item (expert e, rows r0..r0+rows) and output tile [n0, n0 + BN):
//   up   :  h[r, n] = relu(sum_k x[token(r), k] * W_e[n, k])^2          x: [T, K], h: [P, N]
//   down :  y[pair(r), n] = w[pair(r)] * sum_k h[r, k] * W_e[n, k]     h: [P, K], y: [P, N] f32
// W_e: [N, K] row-major (nn.Linear layout), one pointer per expert; token(r) = pair(r) / top_k.
struct GemmParams {
  const void* const* weights;  // [E] device array of expert weight pointers
  const void* x;               // up: x rows gathered by token; down: h in permuted order
  void* out;                   // up: h [P, N]; down: y [P, N] f32, row = pair id
  const int32_t* sorted_pair;  // [P]
  const int4* items;           // work items
  const int32_t* n_items;      // [1]
  const float* topk_weights;   // [P] (down only)
  int N, K, top_k;
  int n_tiles;                 // ceil(N / BN), set by the launcher
  int max_items;               // grid = n_tiles * max_items; items past *n_items exit at once
};

// Tensor-core path (mma.sync m16n8k16, bf16 or f16 activations and weights, fp32 accumulate); requires
// K % 8 == 0, N % 8 == 0 and 16-byte aligned rows. Two tile shapes: kSmall for few rows per expert (decode).
enum class MmaTile { kSmall, kLarge };
int mma_tile_rows(MmaTile tile);  // the BT of the tile shape
void launch_moe_gemm_mma(GemmParams p, DType dtype, MmaTile tile, bool up, cudaStream_t stream);

// Decode path (grouped_gemv.cu): a persistent grid (2 blocks per SM) whose blocks walk "units" of 16 weight rows
// of one active expert (or of the shared expert) x the item's tokens, one warp per 2 weight rows, 16-byte weight
// loads with the next unit's first loads issued before this unit's last FMAs, the unit's token rows staged in shared
// memory, fp32 accumulation, warp-shuffle reduction; bf16 or f16 activations with weights of the same dtype,
// K % 8 == 0, 16-byte aligned rows (the tensor-core path's domain).
// The cut: T <= kGemvMaxTokens. With top-k routing a token picks an expert at most once, so an expert holds at
// most T of the P pairs and, with tile_rows = gemv_tile_rows(T) <= 8 tokens per work item, every active expert's
// weights are streamed once. Per 16-byte weight chunk the SIMT work is ~11 + 12.5 x (tokens of the item) thread
// instructions; at 4.2 TB/s over 132 SMs an SM gets ~1 chunk per cycle and issues 128 thread instructions per
// cycle, so up to 8 tokens per item still fit under the bandwidth (random routing averages ~1.2 tokens per active
// expert at T = 8 for both Nano and Super); beyond that the mma path's 16-token tiles are the better shape. P
// (= T x k, up to 176 for Super at T = 8) is not the criterion: ~150 of Super's 512 experts are active then and
// each still holds one or two tokens.
inline constexpr int64_t kGemvMaxTokens = 8;
inline constexpr int64_t kGemvMaxSmemBytes = 96 * 1024;  // [tile_rows][K] 16-bit token rows; two blocks per SM
int gemv_tile_rows(int64_t T);         // tokens per work item: 1, 2, 4 or 8 (the permutation's tile_rows)
bool gemv_fits(int64_t T, int64_t K);  // T <= kGemvMaxTokens, K % 8 == 0, token rows fit kGemvMaxSmemBytes

// The MoE layer's shared expert as extra units of the same GEMV launches (decode: T <= tile_rows tokens, all of
// them in every unit). Rounding points of ops::relu2_mlp on CUDA (cuBLASLt GEMM into the activation dtype, then the
// in-place relu2 kernel, then the down GEMM into the activation dtype):
//   up:   hs[t, n] = round(relu(round(sum_k x[t, k] * W[n, k]))^2)      x: [T, K], hs: [T, N]
//   down: out[t, n] = round(sum_k hs[t, k] * W[n, k])                   hs: [T, K], out: [T, N]
// weight == nullptr: no shared expert (the routed experts only).
struct GemvShared {
  const void* weight = nullptr;  // [N, K] row-major, the activation dtype, 16-byte aligned rows (K % 8 == 0)
  const void* x = nullptr;       // up: x [T, K] (the hidden state, also for a latent MoE); down: hs [T, K]
  void* out = nullptr;           // up: hs [T, N]; down: shared_out [T, N]; activation dtype
  int N = 0, K = 0, T = 0;       // T <= tile_rows
  // Up only: every shared unit runs before pdl_wait() (launch.cuh, "two back"), overlapping the predecessor (the
  // router): x must be written at least two launches back and the predecessor must not touch `out`.
  bool before_wait = false;
};
// The permutation folded into the GEMV launches (decode: one dependent launch fewer per MoE layer; the combine stays
// its own launch, since folding it into the down launch would make every warp fence its y rows before a count).
//   up   (topk_ids != nullptr): every block sorts the P <= kGemvFoldMaxPairs pairs itself (in shared memory, the
//        same stable order and work items as launch_moe_permute), and block 0 writes sorted_pair / items / n_items
//        for the down launch. No permute launch.
//   down (early_routed): a block whose first unit is routed rebuilds the up launch's permutation itself before its
//        pdl_wait() (the same block sort: the same items and permuted rows) and issues that unit's first weight loads
//        before the wait, instead of waiting for the list the up launch wrote, then its expert's weight pointer. Only
//        when topk_ids was written at least two launches back (launch.cuh, "two back"): the up launch of this fold
//        right before the down launch guarantees it. The same bits either way.
struct GemvFold {
  const int32_t* topk_ids = nullptr;  // [T, top_k]: non-null = fold (up: the permutation; down: the early start)
  int T = 0, E = 0;
  int32_t* sorted_pair = nullptr;     // up: where block 0 writes the permutation for the down launch
  int4* items = nullptr;
  int32_t* n_items = nullptr;
  bool early_routed = false;          // down: the routed units' early start (above)
};
inline constexpr int kGemvFoldMaxPairs = 256;  // one thread per pair in the block sort
// PDL: launched through cuda::launch; the shared expert's weights (constants) are requested before pdl_wait(), and
// with GemvFold::early_routed (down) also a routed first unit's.
void launch_moe_gemv(GemmParams p, const GemvShared& shared, DType dtype, int tile_rows, bool up,
                     cudaStream_t stream, const GemvFold& fold = {});

// fp32 SIMT path: any activation / weight dtype (converted to fp32 on load); h is fp32 here.
inline constexpr int kSimtTileRows = 16;
void launch_moe_gemm_simt(GemmParams p, DType x_dtype, DType w_dtype, bool up, cudaStream_t stream);

// CUTLASS 3.x sm90 grouped GEMM path (cutlass/grouped_gemm_sm90.cu; built only with cmake -DCHIMERA_CUTLASS=ON,
// which defines CHIMERA_HAVE_CUTLASS). bf16 activations and weights, fp32 accumulation, K and N multiples of 8,
// 16-byte aligned weights. Groups: one per work item of a permutation run with tile_rows >= P, i.e. one per active
// expert (item g = {expert, first permuted row, rows}); G = max_items groups are launched, those past *n_items are
// empty (0 rows). Swap-AB, as the mma path: the expert weight W_e [N, K] is CUTLASS's A (M = N weight rows, K-major),
// the expert's token rows are B (N = rows, K-major), and D = out^T is written column-major, i.e. out [rows, N]
// row-major. Launches (all stream-ordered, no host synchronisation, graph-capturable):
//   1. prepare (one kernel): xp[r, :] = x[pair(r) / top_k, :] (TMA cannot gather rows), pair_row[pair(r)] = r, and
//      the per-group problem shapes, pointer and stride arrays of both GEMMs, written on the device from the items;
//   2. up GEMM, epilogue relu(acc)^2 rounded to bf16 -> h [P, I] permuted order (as the mma path);
//   3. down GEMM, epilogue acc in fp32 -> yp [P, D] in permuted order, NOT scaled and NOT scattered: the combine
//      (CombineParams::pair_row) reads row pair_row[pair] and multiplies by the routing weight (bit-identical to
//      the mma path's epilogue scaling: one fp32 product per element, no fma contraction).
struct CutlassExpertsParams {
  const void* const* up_weights;    // [E] device pointers, W_up_e [I, D] bf16
  const void* const* down_weights;  // [E] device pointers, W_down_e [D, I] bf16
  const void* x;                    // [T, D] bf16
  const int32_t* sorted_pair;       // [P] from launch_moe_permute (tile_rows >= P)
  const int4* items;                // [groups]
  const int32_t* n_items;           // [1]
  int P, top_k, D, I;
  int groups;         // max_items = min(P, E): upper bound of the active experts
  void* xp;           // [P, D] bf16 scratch
  void* h;            // [P, I] bf16 scratch
  float* yp;          // [P, D] f32 out, permuted order
  int32_t* pair_row;  // [P] out: the permuted row of each valid pair
  int tile_n = 64;    // tokens per CUTLASS tile: 64 or 128 (experts.cu picks; KernelConfig::moe_cutlass_tile_n forces)
};
// Bytes of device workspace launch_moe_experts_cutlass needs for `groups` groups on the current device (group
// arrays + CUTLASS's per-SM tensor-map workspaces), 256-byte aligned.
size_t cutlass_experts_workspace_bytes(int groups);
void launch_moe_experts_cutlass(const CutlassExpertsParams& p, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream);

// Combine: out[t, :] = sum over the token's pairs, in increasing expert order, of y[t * k + j, :].
// With pair_row (the CUTLASS path): y is in permuted order and unscaled; the term of pair q is
// y[pair_row[q], :] * topk_weights[q] (rounded product, then summed: the same bits as a pre-scaled y).
struct CombineParams {
  const float* y;           // [P, D] f32, row = pair id (already scaled by the routing weight)
  const int32_t* topk_ids;  // [T, k]
  void* out;                // [T, D] (out_dtype)
  int T, k, D, E;
  DType out_dtype;
  const int32_t* pair_row = nullptr;    // [P]: y row of each pair (permuted y), nullptr: row = pair id
  const float* topk_weights = nullptr;  // [P]: with pair_row, the routing weights to apply
};
void launch_moe_combine(const CombineParams& p, cudaStream_t stream);

}  // namespace chimera::cuda::moe
