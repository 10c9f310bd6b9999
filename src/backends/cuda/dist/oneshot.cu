// ONESHOT AllReduce with the Lamport protocol and the fused epilogue: one kernel per call on every rank, no
// barrier. A rank can finish while a slower peer is still pushing; the slot it read is not written again until
// two calls later (lamport_clear_slot), by which time every peer has consumed it.
//
// Shape of the kernel, and why:
//   * Fixed grid of kOneShotGrid blocks whatever the shape, and one Lamport slot counter + clear extent per
//     block (LamportBlockState): block b reads its own counter, pushes its chunk, clears the chunk it pushed
//     in the previous call, and advances its own counter at the end. No device-scope atomic, no fence, no "last
//     block out". The counters stay equal because every block runs in every call; a change of message size
//     between calls is handled because each block recorded the total of the call that used each slot
//     (allreduce_index.h, oneshot_chunk).
//   * The row's residual and the norm weight are loaded into registers before the poll (the weight before
//     pdl_wait, it is a constant), so their HBM latency hides behind the NVLink wait instead of following it.
//   * The poll issues the loads of every rank's vector before spinning on any (2 ranks: compile-time count), so
//     one round trip to L2 covers all ranks instead of one per rank.
//   * This rank's own contribution is read from the input (canonicalised, as the peers received it) instead of
//     being stored into and polled back from its own Lamport region: the push and the clear touch peer regions
//     only, and no thread waits on its own store.
//   * Programmatic dependent launch (launch.cuh): the next kernel's launch and prologue overlap this one's tail.
//     pdl_wait() comes before the slot counter, the input, the residual and the first global write.
//
// Per call, on every rank, block b:
//   0. (before pdl_wait) load the norm weight of its first row's vectors;
//   1. pdl_wait; read its slot s and the total of the call that read slot clear = (s + 2) % 3; load the
//      input and the residual of its first row;
//   2. push chunk b of the input (canonicalised) into region [s][this rank] of every PEER's buffer;
//   3. pdl_trigger; clear chunk b (of that earlier call's total) of every peer region of slot `clear` in the
//      local buffer (every write into it has landed: this rank consumed them in the previous call);
//   4. for rows b, b + grid, ...: poll the local peer regions [s][r] until no lane is empty, sum in rank order
//      with its own input in its place (the same sum, bit for bit, on every rank), fuse (fuse_row_loaded);
//   5. record total for slot s, advance its slot.
// Deadlock freedom: kOneShotGrid <= the SMs, all blocks co-resident, every block pushes before it waits.
// Safety of the clear: stream order (or pdl_wait, which waits for the whole previous grid) puts every read of
// slot `clear` on this rank before step 3, and no peer writes slot `clear` again before this rank has pushed the
// next call's data (lamport_clear_slot).
#include "backends/cuda/dist/fusion_common.cuh"
#include "backends/cuda/launch.cuh"

namespace chimera::cuda::dist {

namespace {

using chimera::dist::kOneShotGrid;
using chimera::dist::oneshot_chunk;

// Thread's vectors of row `row` of a [rows, n_vecs] 16-byte-vector array into raw registers (zero where unused).
// L2 loads (ld.global.cg): the data was written by an earlier kernel, possibly from another SM; not relying on
// L1 being clean at a programmatic-dependent-launch boundary costs nothing here (each vector is read once).
template <int kItems>
__device__ __forceinline__ void load_row(const void* base, int64_t row, int n_vecs, uint4 (&out)[kItems]) {
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
    out[i] = vi < n_vecs ? __ldcg(reinterpret_cast<const uint4*>(base) + row * n_vecs + vi) : make_uint4(0, 0, 0, 0);
  }
}

// input, outputs: [tokens, hidden] T (FusionArgs); Lamport buffers: [3][n_ranks][stride] per rank.
// kRanks: the number of ranks when known at compile time (2: every rank's vector polled at once), 0: p.n_ranks.
template <typename T, FusionPattern P, int kItems, int kRanks>
__global__ void __launch_bounds__(kMaxThreads) oneshot_kernel(const FusionArgs a, const PeerArgs p) {
  constexpr int kN = VecOf<T>::kN;
  const int n_vecs = a.hidden / kN;
  const int n = kRanks > 0 ? kRanks : p.n_ranks;
  const int64_t stride = p.lamport_stride_bytes / 16;  // vectors of one rank's region
  const int64_t total = a.tokens * n_vecs;
  const int block = static_cast<int>(blockIdx.x), grid = static_cast<int>(gridDim.x);

  // 0. The norm weight is the same for every row: load it once, before the wait (a constant of the step).
  uint4 w[kItems] = {};
  if constexpr (has_norm(P)) {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
      w[i] = vi < n_vecs ? __ldg(reinterpret_cast<const uint4*>(a.norm_weight) + vi) : make_uint4(0, 0, 0, 0);
    }
  }

  // 1. Everything below reads what earlier kernels wrote (slot counter, input, residual) or writes.
  pdl_wait();
  LamportBlockState* state = p.lamport_blocks + block;
  // L2 loads: entry b was written by block b of the previous call, which may have run on another SM.
  const int slot = static_cast<int>(__ldcg(&state->slot));
  const int clear = lamport_clear_slot(slot);
  const int64_t cleared_total =
      static_cast<int64_t>(__ldcg(reinterpret_cast<const unsigned long long*>(&state->used_vecs[clear])));
  // This rank's own contribution to its first row comes from the input, not through its own Lamport region.
  uint4 own[kItems] = {}, res[kItems] = {};
  if (block < a.tokens) {
    load_row<kItems>(a.input, block, n_vecs, own);
    // residual_in may alias residual_out: this thread stores each of its vectors only after loading it.
    if constexpr (has_residual(P)) load_row<kItems>(a.residual_in, block, n_vecs, res);
  }

  // 2. push chunk `block` of the message into region [slot][this rank] of every peer's buffer.
  {
    const Range c = oneshot_chunk(block, grid, total);
    lamport_push<T>(a, p, slot, n, stride, c.begin, c.end, 1);  // peers only, the nearest-numbered first
  }
  // The next kernel may launch now; its pdl_wait still waits for this whole grid.
  pdl_trigger();

  // 3. clear the chunk this block's counterparts pushed in the call that read slot `clear`, in every peer region.
  {
    uint4* base = reinterpret_cast<uint4*>(p.lamport[p.rank]);
    const uint4 empty = lamport_empty_vec();
    const Range c = oneshot_chunk(block, grid, cleared_total);
    for (int r = 0; r < n; ++r) {
      if (r == p.rank) continue;  // this rank's own region is never written
      for (int64_t e = c.begin + threadIdx.x; e < c.end; e += blockDim.x) {
        base[lamport_offset(clear, r, e, n, stride)] = empty;
      }
    }
  }

  // 4. wait for every rank's data of each row in the local buffer, sum in rank order, fuse.
  const uint4* local = reinterpret_cast<const uint4*>(p.lamport[p.rank]);
  for (int64_t row = block; row < a.tokens; row += grid) {
    if (row != block) {
      load_row<kItems>(a.input, row, n_vecs, own);
      if constexpr (has_residual(P)) load_row<kItems>(a.residual_in, row, n_vecs, res);
    }
    float acc[kItems][kN] = {};
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
      if (vi >= n_vecs) continue;
      const int64_t e = row * n_vecs + vi;
      // The own vector canonicalised exactly as the peers received it (so every rank sums the same values); a
      // canonical vector is never empty, so the spin below never waits on it.
      const uint4 mine = canonicalise<T>(own[i]);
      if constexpr (kRanks > 0) {
        uint4 u[kRanks];
#pragma unroll
        for (int r = 0; r < kRanks; ++r) {
          u[r] = r == p.rank ? mine : ld_volatile(local + lamport_offset(slot, r, e, kRanks, stride));
        }
#pragma unroll
        for (int r = 0; r < kRanks; ++r) {
          while (has_empty<T>(u[r])) u[r] = ld_volatile(local + lamport_offset(slot, r, e, kRanks, stride));
          add_unpacked<T>(u[r], acc[i]);
        }
      } else {
        for (int r = 0; r < n; ++r) {
          const uint4* src = local + lamport_offset(slot, r, e, n, stride);
          uint4 u = r == p.rank ? mine : ld_volatile(src);
          while (has_empty<T>(u)) u = ld_volatile(src);
          add_unpacked<T>(u, acc[i]);
        }
      }
    }
    fuse_row_loaded<T, P, kItems>(acc, res, w, row, n_vecs, a);
  }

  // 5. this block's state for its next call (read there after the kernel boundary / pdl_wait: no fence). Every
  //    thread read `slot` before this barrier.
  __syncthreads();
  if (threadIdx.x == 0) {
    state->used_vecs[slot] = static_cast<uint64_t>(total);
    state->slot = static_cast<uint32_t>(lamport_next_slot(slot));
  }
}

template <typename T, FusionPattern P, int kItems, int kRanks>
void launch_typed(const FusionArgs& a, const PeerArgs& p, const RowShape& s, cudaStream_t stream) {
  CHIMERA_CUDA_CHECK(cuda::launch(oneshot_kernel<T, P, kItems, kRanks>, dim3(kOneShotGrid),
                                  dim3(static_cast<unsigned>(s.threads)), 0, stream, a, p),
                     "dist::oneshot");
}

}  // namespace

void launch_oneshot(DType dtype, FusionPattern pattern, const FusionArgs& args, const PeerArgs& peers,
                    void* stream) {
  CHIMERA_DISPATCH_FLOAT(dtype, "dist::oneshot", T, {
    const RowShape s = row_shape(args.hidden, static_cast<int>(sizeof(T)));
    CHIMERA_DIST_DISPATCH_PATTERN(pattern, "dist::oneshot", {
      if (peers.n_ranks == 2) {
        CHIMERA_DIST_DISPATCH_ITEMS(s.items, "dist::oneshot",
                                    (launch_typed<T, P, kItems, 2>(args, peers, s, as_stream(stream))));
      } else {
        CHIMERA_DIST_DISPATCH_ITEMS(s.items, "dist::oneshot",
                                    (launch_typed<T, P, kItems, 0>(args, peers, s, as_stream(stream))));
      }
    });
  });
  CHIMERA_LAUNCH_CHECK("dist::oneshot");
}

}  // namespace chimera::cuda::dist
