// TWOSHOT AllReduce: reduce-scatter then all-gather in one kernel, ordered by flag barriers
// (st.release.sys / ld.acquire.sys), with the fused epilogue.
//
// Per call, on every rank, one kernel; block b owns rows t = b, b + grid, ... on every rank, and each row is
// split into n_ranks shares (twoshot_range): rank r reduces share r of every row.
//   0. pdl_wait (launched with programmatic dependent launch when device::pdl_enabled(), launch.cuh);
//   1. push:    for every peer d, copy share d of this block's rows of the input into region [this rank] of d's
//               staging buffer (NVLink stores: fire and forget, many in flight, instead of the remote loads of
//               a pull, whose round trips stall the reduce);
//   barrier 1:  block b of every rank has pushed its rows' shares: the local staging holds every peer's part;
//   2. reduce:  for this rank's share of each of its rows, sum in rank order (this rank's own part read straight
//               from the input, the peers' from the local staging: local loads only), round to T, store into
//               every rank's reduced buffer (NVLink stores);
//   barrier 2:  block b of every rank has written its shares of rows t = b, ...: the local reduced buffer now
//               holds those rows whole;
//   pdl_trigger; 3. gather: read the rows from the local reduced buffer, fuse.
// The push and the reduce walk the block's (row, vector) pairs as one flat index (every thread busy even when a
// share is shorter than the block, e.g. 512 vectors of 1024 threads at hidden 8192 with 2 ranks) and keep
// kInFlight 16-byte loads in flight per thread before they use any of them.
//
// The arithmetic is that of the pull version before it (sum over ranks in rank order in fp32 from 0, round the
// share to T, add the residual to the rounded sum): bit for bit the same outputs.
//
// Reuse across calls without double buffering or a host sync, whatever the shapes of consecutive calls: rank A's
// call N+1 touches no global memory before its pdl_wait / stream-order wait has seen A's call N complete, and A's
// call N completes only after each of its blocks b passed barrier 2 of call N, i.e. after block b of every peer
// finished its reduce of call N (the only reads of A's pushes into that peer's staging) -- for every b of call
// N's grid. So A's pushes of call N+1 never overwrite data a peer still reads. A's reduce of call N+1 writes
// into a peer's reduced buffer only after barrier 1 of call N+1 with that peer's block b, which that block
// reaches only after the peer's call N completed (its gather, the only reads of its reduced buffer). Epochs are
// per block (p.epochs[b], advanced by 2 in every call that has a block b), equal on every rank because every rank
// runs the same shapes in the same order; flags[r][b][s] only grow, so no flag of call N satisfies call N+1.
// Everything lives in device memory, so graph capture and replay work.
#include "backends/cuda/dist/fusion_common.cuh"
#include "backends/cuda/launch.cuh"

namespace chimera::cuda::dist {

namespace {

using chimera::dist::epoch_reached;
using chimera::dist::twoshot_range;
using chimera::dist::twoshot_staging_region;

constexpr int kInFlight = 4;  // 16-byte loads a thread issues before it uses the first (push and reduce)

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Block b of every rank meets here. flags[r][b * kMaxRanks + s] = the last epoch rank s's block b announced
// to rank r. Thread k < n_ranks signals peer k and waits for peer k.
__device__ __forceinline__ void block_barrier(const PeerArgs& p, uint32_t epoch) {
  __syncthreads();  // every thread's writes of this phase precede thread k's release (cumulativity)
  if (static_cast<int>(threadIdx.x) < p.n_ranks) {
    const int peer = static_cast<int>(threadIdx.x);
    __threadfence_system();
    st_release_sys(p.flags[peer] + blockIdx.x * kMaxRanks + p.rank, epoch);
    const uint32_t* mine = p.flags[p.rank] + blockIdx.x * kMaxRanks + peer;
    while (!epoch_reached(ld_acquire_sys(mine), epoch)) {
    }
  }
  __syncthreads();
}

// Flat index i over this block's (row, vector of a share) pairs -> the vector's index in a [tokens, n_vecs]
// array: the block's j-th row is block + j * grid, the share is [begin, begin + len) of the row. 32-bit: a
// message has fewer than 2^31 vectors (AllReduceFusion caps max_message_bytes), and 64-bit indices made the
// unrolled loops spill at 1024 threads (64 registers).
__device__ __forceinline__ int share_elem(int i, int len, int begin, int n_vecs) {
  const int j = i / len;
  return (static_cast<int>(blockIdx.x) + j * static_cast<int>(gridDim.x)) * n_vecs + begin + (i - j * len);
}

// input, outputs: [tokens, hidden] T (FusionArgs); staging: [n_ranks - 1][max message] per rank (region of
// source s: twoshot_staging_region), laid out like the input; reduced: [max message] per rank.
// kRanks: the number of ranks when known at compile time (2), 0: p.n_ranks.
template <typename T, FusionPattern P, int kItems, int kRanks>
__global__ void __launch_bounds__(kMaxThreads) twoshot_kernel(const FusionArgs a, const PeerArgs p) {
  constexpr int kN = VecOf<T>::kN;
  const int n_vecs = a.hidden / kN;
  const int n = kRanks > 0 ? kRanks : p.n_ranks;
  const int block = static_cast<int>(blockIdx.x), grid = static_cast<int>(gridDim.x);
  const int64_t stride = p.lamport_stride_bytes / 16;  // vectors of one staging region (= max message)
  const int rows = static_cast<int>((a.tokens - block + grid - 1) / grid);  // rows block, block + grid, ...
  const int step = static_cast<int>(blockDim.x);
  const uint4* input = reinterpret_cast<const uint4*>(a.input);

  // Everything below reads what earlier kernels wrote (epoch, input, residual) or writes.
  pdl_wait();
  const uint32_t epoch = __ldcg(p.epochs + block);  // written back by thread 0 after the last barrier

  // 1. push share d of the block's rows into region [this rank] of every peer d's staging buffer.
  for (int k = 1; k < n; ++k) {  // the nearest-numbered peer first (a different one on every rank)
    const int dst = (p.rank + k) % n;
    const Range sh = twoshot_range(dst, n, n_vecs);
    const int begin = static_cast<int>(sh.begin), len = static_cast<int>(sh.end - sh.begin), items = rows * len;
    uint4* out = reinterpret_cast<uint4*>(p.staging[dst]) + twoshot_staging_region(p.rank, dst) * stride;
    for (int i0 = static_cast<int>(threadIdx.x); i0 < items; i0 += kInFlight * step) {
      int e[kInFlight];
      uint4 u[kInFlight];
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        const int i = i0 + q * step;
        e[q] = i < items ? share_elem(i, len, begin, n_vecs) : -1;
        if (e[q] >= 0) u[q] = __ldcg(input + e[q]);
      }
#pragma unroll
      for (int q = 0; q < kInFlight; ++q) {
        if (e[q] >= 0) __stcg(out + e[q], u[q]);
      }
    }
  }
  block_barrier(p, epoch + 1);

  // 2. reduce this rank's share of each row (rank order, own part from the input), all-gather it. With the rank
  //    count known at compile time every rank's vectors of kInFlight items are loaded before any is summed;
  //    otherwise rank by rank, two items at a time (fp32 sums of more items spill at 64 registers).
  {
    constexpr int kLoads = kRanks > 0 ? kInFlight : 2;
    const Range sh = twoshot_range(p.rank, n, n_vecs);
    const int begin = static_cast<int>(sh.begin), len = static_cast<int>(sh.end - sh.begin), items = rows * len;
    const uint4* staged = reinterpret_cast<const uint4*>(p.staging[p.rank]);
    for (int i0 = static_cast<int>(threadIdx.x); i0 < items; i0 += kLoads * step) {
      int e[kLoads];
#pragma unroll
      for (int q = 0; q < kLoads; ++q) {
        const int i = i0 + q * step;
        e[q] = i < items ? share_elem(i, len, begin, n_vecs) : -1;
      }
      if constexpr (kRanks > 0) {
        uint4 u[kRanks][kLoads];
#pragma unroll
        for (int r = 0; r < kRanks; ++r) {
          const uint4* src = r == p.rank ? input : staged + twoshot_staging_region(r, p.rank) * stride;
#pragma unroll
          for (int q = 0; q < kLoads; ++q) {
            if (e[q] >= 0) u[r][q] = __ldcg(src + e[q]);
          }
        }
#pragma unroll
        for (int q = 0; q < kLoads; ++q) {
          float acc[kN] = {};
#pragma unroll
          for (int r = 0; r < kRanks; ++r) {
            if (e[q] >= 0) add_unpacked<T>(u[r][q], acc);
          }
          if (e[q] < 0) continue;
          const uint4 v = pack<T>(acc);
          for (int k = 0; k < n; ++k) __stcg(reinterpret_cast<uint4*>(p.reduced[(p.rank + k) % n]) + e[q], v);
        }
      } else {
        float acc[kLoads][kN] = {};
        for (int r = 0; r < n; ++r) {
          const uint4* src = r == p.rank ? input : staged + twoshot_staging_region(r, p.rank) * stride;
          uint4 u[kLoads];
#pragma unroll
          for (int q = 0; q < kLoads; ++q) {
            if (e[q] >= 0) u[q] = __ldcg(src + e[q]);
          }
#pragma unroll
          for (int q = 0; q < kLoads; ++q) {
            if (e[q] >= 0) add_unpacked<T>(u[q], acc[q]);
          }
        }
#pragma unroll
        for (int q = 0; q < kLoads; ++q) {
          if (e[q] < 0) continue;
          const uint4 v = pack<T>(acc[q]);
          for (int k = 0; k < n; ++k) __stcg(reinterpret_cast<uint4*>(p.reduced[(p.rank + k) % n]) + e[q], v);
        }
      }
    }
  }
  block_barrier(p, epoch + 2);
  if (threadIdx.x == 0) p.epochs[blockIdx.x] = epoch + 2;
  // The next kernel may launch now; its pdl_wait still waits for this whole grid.
  pdl_trigger();

  // 3. fuse whole rows from the local reduced buffer.
  const uint4* reduced = reinterpret_cast<const uint4*>(p.reduced[p.rank]);
  for (int64_t row = block; row < a.tokens; row += grid) {
    float acc[kItems][kN] = {};
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * step;
      if (vi < n_vecs) add_unpacked<T>(__ldcg(reduced + row * n_vecs + vi), acc[i]);
    }
    fuse_row<T, P, kItems>(acc, row, n_vecs, a);
  }
}

template <typename T, FusionPattern P, int kItems, int kRanks>
void launch(const FusionArgs& a, const PeerArgs& p, const RowShape& s, cudaStream_t stream) {
  CHIMERA_CUDA_CHECK(cuda::launch(twoshot_kernel<T, P, kItems, kRanks>, dim3(chimera::dist::grid_blocks(a.tokens)),
                                  dim3(static_cast<unsigned>(s.threads)), 0, stream, a, p),
                     "dist::twoshot");
}

}  // namespace

void launch_twoshot(DType dtype, FusionPattern pattern, const FusionArgs& args, const PeerArgs& peers,
                    void* stream) {
  CHIMERA_DISPATCH_FLOAT(dtype, "dist::twoshot", T, {
    const RowShape s = row_shape(args.hidden, static_cast<int>(sizeof(T)));
    CHIMERA_DIST_DISPATCH_PATTERN(pattern, "dist::twoshot", {
      if (peers.n_ranks == 2) {
        CHIMERA_DIST_DISPATCH_ITEMS(s.items, "dist::twoshot", (launch<T, P, kItems, 2>(args, peers, s, as_stream(stream))));
      } else {
        CHIMERA_DIST_DISPATCH_ITEMS(s.items, "dist::twoshot", (launch<T, P, kItems, 0>(args, peers, s, as_stream(stream))));
      }
    });
  });
  CHIMERA_LAUNCH_CHECK("dist::twoshot");
}

}  // namespace chimera::cuda::dist
