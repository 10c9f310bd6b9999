// TWOSHOT AllReduce (seed 4.2.2): reduce-scatter then all-gather in one kernel, ordered by flag barriers
// (st.release.sys / ld.acquire.sys), with the fused epilogue (seed 6.3).
//
// Per call, on every rank, one kernel; block b owns rows t = b, b + grid, ... on every rank:
//   1. stage:   copy this block's rows of the input into this rank's staging buffer (local);
//   barrier 1:  block b of every rank has staged its rows;
//   2. reduce:  for each of its rows, read this rank's share of the row (twoshot_range) from every rank's
//               staging buffer (NVLink loads), sum in rank order, round to T, store into every rank's
//               reduced buffer (NVLink stores);
//   barrier 2:  block b of every rank has written its shares of rows t = b, ...: the local reduced buffer now
//               holds those rows whole;
//   3. gather:  read the rows from the local reduced buffer, fuse.
// Reuse across calls is safe without double buffering: a peer writes into this rank's buffers only after
// barrier 1 of its next call, which this rank's block reaches only after its whole previous kernel finished.
#include "backends/cuda/dist/fusion_common.cuh"

namespace chimera::cuda::dist {

namespace {

using chimera::dist::epoch_reached;
using chimera::dist::Range;
using chimera::dist::twoshot_range;

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

template <typename T, FusionPattern P, int kItems>
__global__ void __launch_bounds__(kMaxThreads) twoshot_kernel(const FusionArgs a, const PeerArgs p) {
  constexpr int kN = VecOf<T>::kN;
  const int n_vecs = a.hidden / kN;
  const int n = p.n_ranks;
  const uint32_t epoch = p.epochs[blockIdx.x];  // written back by thread 0 after the last barrier

  // 1. stage
  uint4* staging = reinterpret_cast<uint4*>(p.staging[p.rank]);
  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    for (int vi = static_cast<int>(threadIdx.x); vi < n_vecs; vi += static_cast<int>(blockDim.x)) {
      __stcg(staging + row * n_vecs + vi, __ldg(reinterpret_cast<const uint4*>(a.input) + row * n_vecs + vi));
    }
  }
  block_barrier(p, epoch + 1);

  // 2. reduce-scatter this rank's share of each row, all-gather it into every rank's reduced buffer.
  const Range share = twoshot_range(p.rank, n, n_vecs);
  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    for (int64_t vi = share.begin + threadIdx.x; vi < share.end; vi += blockDim.x) {
      const int64_t e = row * n_vecs + vi;
      float acc[kN] = {};
      for (int r = 0; r < n; ++r) add_unpacked<T>(__ldcg(reinterpret_cast<const uint4*>(p.staging[r]) + e), acc);
      const uint4 u = pack<T>(acc);
      for (int k = 0; k < n; ++k) __stcg(reinterpret_cast<uint4*>(p.reduced[(p.rank + k) % n]) + e, u);
    }
  }
  block_barrier(p, epoch + 2);
  if (threadIdx.x == 0) p.epochs[blockIdx.x] = epoch + 2;

  // 3. fuse whole rows from the local reduced buffer.
  const uint4* reduced = reinterpret_cast<const uint4*>(p.reduced[p.rank]);
  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    float acc[kItems][kN] = {};
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
      if (vi < n_vecs) add_unpacked<T>(__ldcg(reduced + row * n_vecs + vi), acc[i]);
    }
    fuse_row<T, P, kItems>(acc, row, n_vecs, a);
  }
}

template <typename T, FusionPattern P, int kItems>
void launch(const FusionArgs& a, const PeerArgs& p, const RowShape& s, cudaStream_t stream) {
  twoshot_kernel<T, P, kItems><<<chimera::dist::grid_blocks(a.tokens), s.threads, 0, stream>>>(a, p);
}

}  // namespace

void launch_twoshot(DType dtype, FusionPattern pattern, const FusionArgs& args, const PeerArgs& peers,
                    void* stream) {
  CHIMERA_DISPATCH_FLOAT(dtype, "dist::twoshot", T, {
    const RowShape s = row_shape(args.hidden, static_cast<int>(sizeof(T)));
    CHIMERA_DIST_DISPATCH_PATTERN(pattern, "dist::twoshot", {
      CHIMERA_DIST_DISPATCH_ITEMS(s.items, "dist::twoshot", (launch<T, P, kItems>(args, peers, s, as_stream(stream))));
    });
  });
  CHIMERA_LAUNCH_CHECK("dist::twoshot");
}

}  // namespace chimera::cuda::dist
