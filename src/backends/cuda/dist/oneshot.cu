// ONESHOT AllReduce with the Lamport protocol and the fused epilogue.
//
// Per call, on every rank, one kernel:
//   1. push:   each block copies its rows of the input (canonicalised, allreduce_index.h) into region
//              [slot][this rank] of EVERY rank's Lamport buffer (NVLink stores to peers, one local store);
//   2. clear:  the regions of the slot the previous call read are refilled with the empty pattern (local; all
//              blocks share the work);
//   3. reduce: each thread polls its vectors of region [slot][r] in the LOCAL buffer until no lane is empty,
//              for r = 0..n-1 in rank order (the same sum, bit for bit, on every rank), then fuses;
//   4. the last block to finish records the slot's used extent and advances the device-side slot counter.
// No barrier: a rank can finish while a slower peer is still pushing; the slot it read is not written again
// until two calls later (see lamport_clear_slot), by which time every peer has consumed it.
#include "backends/cuda/dist/fusion_common.cuh"

namespace chimera::cuda::dist {

namespace {

using chimera::dist::lamport_clear_elems;
using chimera::dist::lamport_clear_offset;

// input, outputs: [tokens, hidden] T (FusionArgs); Lamport buffers: [3][n_ranks][stride] per rank.
template <typename T, FusionPattern P, int kItems>
__global__ void __launch_bounds__(kMaxThreads) oneshot_kernel(const FusionArgs a, const PeerArgs p) {
  constexpr int kN = VecOf<T>::kN;
  const int n_vecs = a.hidden / kN;
  const int n = p.n_ranks;
  const int64_t stride = p.lamport_stride_bytes / 16;  // vectors of one rank's region
  LamportState* state = p.lamport_state;
  const int slot = static_cast<int>(*reinterpret_cast<volatile uint32_t*>(&state->slot));

  // 1. push: the message's vectors in one contiguous chunk per block, so that every block of the grid (more
  //    blocks than rows for small messages: a single SM's stores to a peer are far below the link's rate) sends
  //    its share to every rank before any block waits in step 3. All blocks are co-resident (oneshot_blocks <= kMaxBlocks), so a
  //    waiting block never holds back a push.
  {
    const int64_t total = a.tokens * n_vecs;
    const int64_t chunk = (total + gridDim.x - 1) / gridDim.x;
    const int64_t end = min(total, (blockIdx.x + 1) * chunk);
    lamport_push<T>(a, p, slot, n, stride, blockIdx.x * chunk, end, 0);
  }

  // 2. clear the slot the previous call read (only this rank reads it; every write into it has landed): the
  //    n_ranks message regions that call used, not the whole slot (allreduce_index.h).
  {
    const int clear = lamport_clear_slot(slot);
    const int64_t msg = static_cast<int64_t>(state->used_vecs[clear]);
    uint4* base = reinterpret_cast<uint4*>(p.lamport[p.rank]);
    const uint4 empty = lamport_empty_vec();
    const int64_t total = msg > 0 ? lamport_clear_elems(n, msg) : 0;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      base[lamport_clear_offset(clear, j, n, msg, stride)] = empty;
    }
  }

  // 3. wait for every rank's data in the local buffer, sum in rank order, fuse.
  const uint4* local = reinterpret_cast<const uint4*>(p.lamport[p.rank]);
  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    float acc[kItems][kN] = {};
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
      if (vi >= n_vecs) continue;
      const int64_t e = row * n_vecs + vi;
      for (int r = 0; r < n; ++r) {
        const uint4* src = local + lamport_offset(slot, r, e, n, stride);
        uint4 u = ld_volatile(src);
        while (has_empty<T>(u)) u = ld_volatile(src);
        add_unpacked<T>(u, acc[i]);
      }
    }
    fuse_row<T, P, kItems>(acc, row, n_vecs, a);
  }

  // 4. the last block out advances the counter (every block read `slot` before it counted itself done).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(&state->blocks_done, 1u);
    if (done == gridDim.x - 1) {
      state->used_vecs[slot] = static_cast<uint64_t>(a.tokens * n_vecs);
      state->blocks_done = 0;
      *reinterpret_cast<volatile uint32_t*>(&state->slot) = static_cast<uint32_t>(lamport_next_slot(slot));
      __threadfence();
    }
  }
}

template <typename T, FusionPattern P, int kItems>
void launch(const FusionArgs& a, const PeerArgs& p, const RowShape& s, cudaStream_t stream) {
  oneshot_kernel<T, P, kItems><<<chimera::dist::oneshot_blocks(a.tokens, s.n_vecs), s.threads, 0, stream>>>(a, p);
}

}  // namespace

void launch_oneshot(DType dtype, FusionPattern pattern, const FusionArgs& args, const PeerArgs& peers,
                    void* stream) {
  CHIMERA_DISPATCH_FLOAT(dtype, "dist::oneshot", T, {
    const RowShape s = row_shape(args.hidden, static_cast<int>(sizeof(T)));
    CHIMERA_DIST_DISPATCH_PATTERN(pattern, "dist::oneshot", {
      CHIMERA_DIST_DISPATCH_ITEMS(s.items, "dist::oneshot", (launch<T, P, kItems>(args, peers, s, as_stream(stream))));
    });
  });
  CHIMERA_LAUNCH_CHECK("dist::oneshot");
}

}  // namespace chimera::cuda::dist
