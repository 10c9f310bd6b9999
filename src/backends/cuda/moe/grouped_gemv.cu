// Grouped expert GEMV for decode (few tokens per active expert), optionally with the MoE layer's shared expert
// as extra work in the same launch: the same work list and output contract as the grouped GEMMs (moe_kernels.h),
// but shaped to stream each active expert's weights once at close to the full HBM bandwidth:
//   up:   h[r, n] = relu(sum_k x[token(r), k] * W_e[n, k])^2, rounded to the activation dtype (as HF) -> h [P, I]
//   down: y[pair(r), n] = w[pair(r)] * sum_k h[r, k] * W_e[n, k] in fp32 -> y [P, D], row = pair id
//   shared (GemvShared): relu2_mlp's up / down with its rounding points, all T tokens in every unit.
//
// Why persistent: at T = 1 (Nano: 6 experts x [1856, 2688] up + [2688, 1856] down, 120 MB) the earlier
// one-block-per-(item, 16 rows) grid gave 700-1000 blocks of 59-86 KB, each of which first waited for two dependent
// L2 round trips (its work item, then the expert's weight pointer) and staged its token rows before its first
// weight byte arrived, and then ran only 2-3 load steps: a quarter of a block's life had no weight loads in flight,
// and the 2.6 waves left a partial last wave. Here the grid is 2
// blocks per SM, each block walks units u = blockIdx.x, + gridDim.x, ...; the next unit's work item and weight
// pointer are read while this unit streams, and its first weight loads are issued before this unit's last FMAs,
// so every lane keeps 8 x 16-byte loads in flight (64 KB per SM) across unit boundaries: what ~4 TB/s over 132
// SMs needs at ~1 us of loaded HBM latency (4.2 MB in flight).
//
// Unit: kRowsPerBlock = 16 consecutive weight rows of one expert x the item's tokens (at most NT = the
// permutation's tile_rows); warp w owns rows 2w, 2w + 1. Units [0, shared_tiles) are the shared expert's (first, so
// a block's first unit, when it is one, can request its constant weights before pdl_wait()), then the routed
// items', item-major: unit shared_tiles + i * n_tiles + j = item i, rows [16 j, 16 j + 16). The unit's token rows
// (x gathered by token for up, h rows for down, the shared expert's T rows) are staged in shared memory, [NT][K]
// in the activation dtype. Lane l reads the 16-byte chunks c = l, l + 32, ... of its rows (kUnroll chunks per row
// per step, the next step's loads issued before this step's FMAs), converts to fp32, multiplies with the same
// chunk of each token, accumulates in fp32 and the warp reduces with shuffles: a fixed order, so the results are
// deterministic and independent of the grid size. No host sync: the unit count is read on the device, so the
// launch can be captured in a CUDA graph.
#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/moe/moe_kernels.h"

namespace chimera::cuda::moe {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kBlocksPerSm = 2;            // smem: [NT][K] <= 96 KB per block
constexpr int kUnroll = 4;                 // 16-byte chunks per row and lane per step
constexpr int kStepChunks = 32 * kUnroll;  // chunks of a row one step covers (1024 16-bit elements)
constexpr int kRows = 2;                   // weight rows per warp (share the token chunks from smem)
constexpr int kRowsPerBlock = kWarps * kRows;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct GemvArgs {
  GemmParams g;      // routed experts; g.n_tiles = ceil(g.N / kRowsPerBlock)
  GemvShared s;      // s.weight == nullptr: no shared expert
  int shared_tiles;  // ceil(s.N / kRowsPerBlock), 0 without a shared expert
  GemvFold f;        // f.topk_ids == nullptr: the permutation launched separately
};

// The up launch's own permutation (GemvFold): pairs sorted by (expert, pair id), the work items of NT rows.
struct PermuteSmem {
  int ids[kGemvFoldMaxPairs];
  int sorted[kGemvFoldMaxPairs];
  int flag[kGemvFoldMaxPairs];  // by rank: 1 where an item starts
  int4 items[kGemvFoldMaxPairs];
};
static_assert(kGemvFoldMaxPairs <= kThreads, "one thread per pair");

// Thread i < P takes pair i: its rank among the valid pairs in (expert, pair id) order, its position among its
// expert's pairs and the expert's count, by one pass over the P ids in shared memory (P <= 256: cheaper than a
// launch). An item starts at every NT-th pair of an expert; its index is the number of starts at lower ranks, so
// the items come out expert-major with the rows and counts of launch_moe_permute. Block 0 also writes the result
// to global memory for the down launch (`publish`: the up launch, after its pdl_wait(); the down launch's early
// rebuild, before its wait, writes shared memory only). Returns the item count. All threads of the block must call
// it.
template <int NT>
__device__ int block_permute(const GemvArgs& a, PermuteSmem& ps, bool publish) {
  const int tid = static_cast<int>(threadIdx.x);
  const int P = a.f.T * a.g.top_k, E = a.f.E;
  if (tid < P) ps.ids[tid] = __ldcg(a.f.topk_ids + tid);  // from L2 (the down launch reads it before its wait)
  __syncthreads();
  int e = -1, rank = 0, pos = 0, cnt = 0;
  bool valid = false;
  if (tid < P) {
    e = ps.ids[tid];
    valid = e >= 0 && e < E;
    for (int j = 0; j < P; ++j) {
      const int ej = ps.ids[j];
      const bool vj = ej >= 0 && ej < E;
      rank += vj && (ej < e || (ej == e && j < tid)) ? 1 : 0;
      pos += ej == e && j < tid ? 1 : 0;
      cnt += ej == e ? 1 : 0;
    }
  }
  const bool start = valid && pos % NT == 0;
  if (valid) {
    ps.sorted[rank] = tid;
    ps.flag[rank] = start ? 1 : 0;
  }
  const int n_items = __syncthreads_count(start);
  const bool writer = publish && blockIdx.x == 0;
  if (valid && writer) a.f.sorted_pair[rank] = tid;
  if (start) {
    int idx = 0;
    for (int r = 0; r < rank; ++r) idx += ps.flag[r];
    const int4 item = make_int4(e, rank, min(NT, cnt - pos), 0);
    ps.items[idx] = item;
    if (writer) a.f.items[idx] = item;
  }
  if (writer && tid == 0) *a.f.n_items = n_items;
  __syncthreads();
  return n_items;
}

// One unit as this warp sees it (kept small: the current and the next one are live at once).
struct Unit {
  const uint4* w;  // the expert's weight matrix [N, KC] in 16-byte chunks
  int row0;        // this warp's first row; rows past N read row N - 1 and store nothing
  int N, KC, nt;   // rows, 16-byte chunks per row, tokens
  int r0;          // routed: the item's first permuted row
  bool shared;
  __device__ __forceinline__ bool active() const { return row0 < N; }
  __device__ __forceinline__ const uint4* row(int r) const {
    return w + static_cast<int64_t>(min(row0 + r, N - 1)) * KC;
  }
};

__device__ __forceinline__ Unit make_unit(const void* W, int N, int K, int tile, int nt, int r0, bool shared,
                                          int warp) {
  return Unit{static_cast<const uint4*>(W), tile * kRowsPerBlock + warp * kRows, N, K / 8, nt, r0, shared};
}

// Unit u of the launch in two halves, so the dependent reads of a routed unit (its work item, then the expert's
// weight pointer) can straddle other work: item_of reads items[] (a placeholder for a shared unit), unit_of the
// weight pointer. Shared units read no device state (allowed before pdl_wait()); routed ones only after it.
__device__ __forceinline__ int4 item_of(const GemvArgs& a, const int4* items, int u) {
  return u < a.shared_tiles ? make_int4(0, 0, 0, 0) : items[(u - a.shared_tiles) / a.g.n_tiles];
}
__device__ __forceinline__ Unit unit_of(const GemvArgs& a, int u, const int4& item, int warp) {
  if (u < a.shared_tiles) return make_unit(a.s.weight, a.s.N, a.s.K, u, a.s.T, 0, true, warp);
  return make_unit(a.g.weights[item.x], a.g.N, a.g.K, (u - a.shared_tiles) % a.g.n_tiles, item.z, item.y, false,
                   warp);
}

// NT: the most tokens a unit holds; the unit's actual count nt <= NT is uniform over the block, so the `t < nt`
// tests below are uniform branches.
template <typename T, int NT, bool kUp>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) moe_gemv_kernel(const GemvArgs a) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  uint4* xs = reinterpret_cast<uint4*>(gemv_smem);  // [NT][KC] chunks of the unit's token rows
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;

  uint4 wnext[kRows][kUnroll];
  auto load_step = [&](const Unit& un, int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32 + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        wnext[r][u] = un.active() && c < un.KC ? ld_stream(un.row(r) + c) : make_uint4(0, 0, 0, 0);
      }
    }
  };

  int u = static_cast<int>(blockIdx.x);
  Unit cur{};
  __shared__ PermuteSmem ps;  // (fold) the block's own permutation: up always, down with GemvFold::early_routed
  const int4* items = a.g.items;
  const int32_t* sorted_pair = a.g.sorted_pair;
  // The shared expert's weights are constants: its first loads go out before the wait, overlapping the
  // predecessor's tail (PDL). With GemvShared::before_wait (up only) the block runs all its shared units before the
  // wait: their input is the hidden state, written at least two launches back (launch.cuh, "two back"), and their
  // output hs is a buffer of this op that the predecessor (the router) does not touch.
  const bool first_shared = u < a.shared_tiles;
  const bool early = kUp && first_shared && a.s.before_wait;
  if (first_shared) {
    cur = unit_of(a, u, int4{}, warp);
    load_step(cur, 0);
  }
  // (fold, down) GemvFold::early_routed, in a block whose first unit is routed: topk_ids was written at least two
  // launches back (the router; the up launch is the predecessor: launch.cuh, "two back"), so the block rebuilds the
  // up launch's work list before the wait (block_permute, the same deterministic sort: the same items, hence the same
  // permuted rows r0 of h) and issues its first unit's first weight loads (constants, through the constant pointer
  // table) before the wait too, instead of wait -> n_items / items -> weight pointer -> load after it. It reads h
  // (the predecessor's output) only after the wait, and writes nothing before it. Blocks whose first unit is shared
  // keep reading the list that the up launch's block 0 wrote, after the wait.
  const bool early_routed = !kUp && !first_shared && a.f.topk_ids != nullptr && a.f.early_routed;  // block-uniform
  int total = a.shared_tiles;  // before the wait (early): the shared units only
  int early_items = 0;
  if (early_routed) {
    early_items = block_permute<NT>(a, ps, false);
    total = a.shared_tiles + early_items * a.g.n_tiles;
    items = ps.items;
    sorted_pair = ps.sorted;
    if (u < total) {
      cur = unit_of(a, u, item_of(a, items, u), warp);
      load_step(cur, 0);
    }
  }
  bool waited = false;

  while (true) {
    if (!waited && !(early && u < a.shared_tiles)) {
      pdl_wait();  // permute's items / the up kernel's h are visible from here; no other global write before it
      pdl_trigger();
      waited = true;
      // The work list: the permute launch's, or (fold, up) this block's own sort.
      int n_items = 0;
      if constexpr (kUp) {
        if (a.f.topk_ids != nullptr) {
          n_items = block_permute<NT>(a, ps, true);
          items = ps.items;
          sorted_pair = ps.sorted;
        } else {
          n_items = *a.g.n_items;
        }
      } else {
        n_items = early_routed ? early_items : *a.g.n_items;
      }
      total = a.shared_tiles + n_items * a.g.n_tiles;
      if (u >= total) return;        // uniform over the block, before any barrier
      if ((!first_shared || early) && !early_routed) {  // (early: the first unit after the shared ones)
        cur = unit_of(a, u, item_of(a, items, u), warp);
        load_step(cur, 0);
      }
    }
    // The next unit's descriptor is fetched while this unit streams: its work item now (overlapping the staging
    // reads), the expert's weight pointer after the staging.
    const int un = u + static_cast<int>(gridDim.x);
    const bool has_next = un < total;
    const int4 next_item = has_next ? item_of(a, items, un) : int4{};
    __syncthreads();  // the previous unit's readers of xs are done
    // Stage the unit's token rows. Routed up: x row of the pair's token; routed down: h row r0 + m (permuted
    // order); shared: row m of its input.
    {
      const int KC = cur.KC;
      const uint4* X = static_cast<const uint4*>(cur.shared ? a.s.x : a.g.x);
      for (int i = tid; i < cur.nt * KC; i += kThreads) {
        const int m = i / KC, c = i - m * KC;
        const int64_t src = cur.shared ? m : kUp ? sorted_pair[cur.r0 + m] / a.g.top_k : cur.r0 + m;
        xs[m * KC + c] = X[src * KC + c];
      }
    }
    Unit nxt = cur;
    if (has_next) nxt = unit_of(a, un, next_item, warp);
    __syncthreads();

    float acc[kRows][NT];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

    const int KC = cur.KC, nt = cur.nt;
    for (int c0 = 0; c0 < KC; c0 += kStepChunks) {
      uint4 wcur[kRows][kUnroll];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int v = 0; v < kUnroll; ++v) wcur[r][v] = wnext[r][v];
      // In flight during this step's FMAs: this unit's next step, or the next unit's first one.
      if (c0 + kStepChunks < KC) {
        load_step(cur, c0 + kStepChunks);
      } else if (has_next) {
        load_step(nxt, 0);
      }
#pragma unroll
      for (int v = 0; v < kUnroll; ++v) {
        const int c = c0 + v * 32 + lane;
        if (c >= KC) break;  // chunks past the row: only in the row's last step
        float wf[kRows][8];
#pragma unroll
        for (int r = 0; r < kRows; ++r) unpack8<T>(wcur[r][v], wf[r]);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t >= nt) break;
          float xf[8];
          unpack8<T>(xs[t * KC + c], xf);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r][t] = fmaf(wf[r][j], xf[j], acc[r][t]);
        }
      }
    }

    // Reduce over the lanes; lane t stores token t's outputs (rows row0 .. row0 + kRows - 1).
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= nt) break;
      float v[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) v[r] = warp_sum(acc[r][t]);
      if (lane != t || !cur.active()) continue;
      const int row0 = cur.row0, N = cur.N;
      if (cur.shared) {
        T* o = static_cast<T*>(a.s.out) + static_cast<int64_t>(t) * N;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (row0 + r >= N) continue;
          if constexpr (kUp) {
            // relu2_mlp: the GEMM rounds to the activation dtype, then relu2 squares that value and rounds again.
            const float g = fmaxf(to_float<T>(from_float<T>(v[r])), 0.0f);
            o[row0 + r] = from_float<T>(g * g);
          } else {
            o[row0 + r] = from_float<T>(v[r]);
          }
        }
      } else if constexpr (kUp) {
        T* h = static_cast<T*>(a.g.out) + static_cast<int64_t>(cur.r0 + t) * N;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float g = fmaxf(v[r], 0.0f);
          if (row0 + r < N) h[row0 + r] = from_float<T>(g * g);
        }
      } else {
        const int pair = sorted_pair[cur.r0 + t];
        const float w = a.g.topk_weights[pair];
        float* y = static_cast<float*>(a.g.out) + static_cast<int64_t>(pair) * N;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (row0 + r < N) y[row0 + r] = v[r] * w;
        }
      }
    }
    u = un;
    if (!has_next) {
      if (waited) break;
      continue;  // the early shared units are done: wait, then the routed units
    }
    cur = nxt;
  }
}

template <typename T, int NT, bool kUp>
void launch(const GemvArgs& a, cudaStream_t stream) {
  // Units: an upper bound (max_items routed items); the kernel reads the real count.
  const int64_t units = static_cast<int64_t>(a.shared_tiles) + static_cast<int64_t>(a.g.n_tiles) * a.g.max_items;
  if (units == 0) return;
  if (units > 0x7fffffff) throw_runtime(str_cat("ops::moe_experts: ", units, " GEMV units is too many"));
  const int64_t blocks = std::min<int64_t>(units, static_cast<int64_t>(kBlocksPerSm) * sm_count());
  const int kmax = std::max(a.g.K, a.s.weight ? a.s.K : 0);
  const size_t smem = static_cast<size_t>(NT) * kmax * sizeof(T);
  static const bool configured = [] {
    set_max_dynamic_smem(moe_gemv_kernel<T, NT, kUp>, kGemvMaxSmemBytes, "ops::moe_experts");
    return true;
  }();
  (void)configured;
  CHIMERA_CUDA_CHECK(cuda::launch(moe_gemv_kernel<T, NT, kUp>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                                  smem, stream, a),
                     "ops::moe_experts");
}

template <typename T, int NT>
void launch_nt(const GemvArgs& a, bool up, cudaStream_t stream) {
  up ? launch<T, NT, true>(a, stream) : launch<T, NT, false>(a, stream);
}

template <typename T>
void launch_dtype(const GemvArgs& a, int tile_rows, bool up, cudaStream_t stream) {
  switch (tile_rows) {
    case 1: return launch_nt<T, 1>(a, up, stream);
    case 2: return launch_nt<T, 2>(a, up, stream);
    case 4: return launch_nt<T, 4>(a, up, stream);
    case 8: return launch_nt<T, 8>(a, up, stream);
    default: throw_runtime(str_cat("ops::moe_experts: GEMV tile of ", tile_rows, " tokens (supported: 1, 2, 4, 8)"));
  }
}

}  // namespace

int gemv_tile_rows(int64_t T) {
  return T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8;
}

bool gemv_fits(int64_t T, int64_t K) {
  return T <= kGemvMaxTokens && K % 8 == 0 && static_cast<int64_t>(gemv_tile_rows(T)) * K * 2 <= kGemvMaxSmemBytes;
}

void launch_moe_gemv(GemmParams p, const GemvShared& shared, DType dtype, int tile_rows, bool up,
                     cudaStream_t stream, const GemvFold& fold) {
  const int kmax = std::max(p.K, shared.weight ? shared.K : 0);
  if (p.K % 8 != 0 || static_cast<int64_t>(tile_rows) * kmax * 2 > kGemvMaxSmemBytes) {
    throw_runtime(str_cat("ops::moe_experts: the GEMV path needs K % 8 == 0 and ", tile_rows,
                          " x K x 2 <= ", kGemvMaxSmemBytes, " bytes (K = ", kmax, ")"));
  }
  if (shared.weight && (shared.K % 8 != 0 || shared.N < 1 || shared.T < 1 || shared.T > tile_rows)) {
    throw_runtime(str_cat("ops::moe_experts: the GEMV shared expert needs K % 8 == 0 and 1 <= T <= ", tile_rows,
                          " (K = ", shared.K, ", N = ", shared.N, ", T = ", shared.T, ")"));
  }
  if (fold.topk_ids != nullptr) {
    const bool down_ok = fold.early_routed;
    const bool ok = fold.T >= 1 && fold.T <= tile_rows && fold.T * p.top_k <= kGemvFoldMaxPairs &&
                    (up ? fold.sorted_pair && fold.items && fold.n_items : down_ok);
    if (!ok) {
      throw_runtime(str_cat("ops::moe_experts: GEMV fold with T = ", fold.T, ", top-", p.top_k, " (needs T <= ",
                            tile_rows, ", T x top_k <= ", kGemvFoldMaxPairs, " and its output buffers)"));
    }
  }
  GemvArgs a{};
  a.f = fold;
  a.g = p;
  a.g.n_tiles = (p.N + kRowsPerBlock - 1) / kRowsPerBlock;
  a.s = shared;
  a.shared_tiles = shared.weight ? (shared.N + kRowsPerBlock - 1) / kRowsPerBlock : 0;
  switch (dtype) {
    case DType::kBF16: return launch_dtype<__nv_bfloat16>(a, tile_rows, up, stream);
    case DType::kF16: return launch_dtype<__half>(a, tile_rows, up, stream);
    default: throw_runtime(str_cat("ops::moe_experts: the GEMV path takes BF16 or F16, not ", dtype_name(dtype)));
  }
}

}  // namespace chimera::cuda::moe
