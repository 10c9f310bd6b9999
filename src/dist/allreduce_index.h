// The index arithmetic of the custom AllReduce kernels, as plain inline functions usable on the host and the
// device, so that the CPU tests (tests/dist/allreduce_index_test.cpp) check exactly what the kernels compute
// for 2, 4 and 8 ranks. No CUDA types, no allocation.
//
// The designs follow TensorRT-LLM's fused AllReduce: ONESHOT with the Lamport protocol (a triple buffer: call n
// uses slot n % 3 and clears slot (n + 2) % 3), TWOSHOT (reduce-scatter, barrier, all-gather), and a lookup table
// keyed (ranks index, fusion index, hidden bucket, tokens bucket) (docs/architecture.md, tensor parallelism).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CHIMERA_HD __host__ __device__ __forceinline__
#else
#define CHIMERA_HD inline
#endif

namespace chimera::dist {

inline constexpr int kMaxRanks = 8;
inline constexpr int kLamportSlots = 3;  // triple buffer: read slot, slot being cleared, slot ready next

// Lamport sentinel: every 16-bit lane of an empty buffer holds 0x8000 (-0.0 in bf16 and fp16). One pattern for
// every dtype, because a slot cleared by a bf16 call may be read next by an fp32 call: an fp32 element is empty
// when both halves are 0x8000 (0x80008000, the denormal -1.8e-40). Real inputs with the sentinel pattern are
// canonicalised before they are pushed (16-bit -0.0 -> +0.0; fp32 0x80008000 -> -0.0f), so they cannot hang
// a reader.
inline constexpr uint16_t kLamportEmpty16 = 0x8000u;
inline constexpr uint32_t kLamportEmpty32 = 0x80008000u;

// ---- ONESHOT triple buffer -------------------------------------------------------------------------------
// The device-side counter holds the slot the next call reads (0, 1, 2, then 0 again: kept modulo 3 so it never
// wraps out of step, as a free-running 32-bit counter would at 2^32, which 3 does not divide). A call reading
// slot s clears the slot the previous call read, (s + 2) % 3: every peer's write into that slot has landed
// (this rank consumed them), and it is next written two calls later, which no peer can start before this rank
// has pushed the next call's data.
CHIMERA_HD int lamport_clear_slot(int slot) { return (slot + 2) % kLamportSlots; }
CHIMERA_HD int lamport_next_slot(int slot) { return (slot + 1) % kLamportSlots; }

// Element offset, inside one rank's Lamport buffer, of element `elem` of the message pushed by `src_rank` in
// `slot`. Layout: [slot][src_rank][message elements], each message region `slot_stride_elems` long (the
// capacity: max message bytes / element size); a slot holds n_ranks regions.
CHIMERA_HD int64_t lamport_offset(int slot, int src_rank, int64_t elem, int n_ranks, int64_t slot_stride_elems) {
  return (static_cast<int64_t>(slot) * n_ranks + src_rank) * slot_stride_elems + elem;
}
// The clear of a slot covers only what the call that read it used: element j in [0, n_ranks x message_elems)
// of the clear is element j % message_elems of source region j / message_elems. (Clearing the contiguous
// extent from region 0 to the end of the last message would touch (n_ranks - 1) x capacity elements every call:
// 64 MiB per call with the default workspace, longer than the whole small-message AllReduce.)
CHIMERA_HD int64_t lamport_clear_elems(int n_ranks, int64_t message_elems) {
  return static_cast<int64_t>(n_ranks) * message_elems;
}
CHIMERA_HD int64_t lamport_clear_offset(int slot, int64_t j, int n_ranks, int64_t message_elems,
                                        int64_t slot_stride_elems) {
  const int src = static_cast<int>(j / message_elems);
  return lamport_offset(slot, src, j - static_cast<int64_t>(src) * message_elems, n_ranks, slot_stride_elems);
}

// ---- TWOSHOT ownership ------------------------------------------------------------------------------------
// Every row (token) is split into n_ranks contiguous ranges of 16-byte vectors; rank r reduces range r of the
// row (every peer pushed its part of range r into r's staging buffer; r sums in rank order, its own part from
// its input, and writes the sum into every rank's reduced buffer). Splitting each row, rather than the token list, keeps one block on one set of rows through both
// phases on every rank, so the per-block barriers order every write a block later reads (the all-gather of
// row t reads only what the peers' block of row t wrote before they reached barrier 2). The first
// n_vecs % n_ranks ranks own one vector more, so ranges differ by at most one vector and cover the row.
struct Range {
  int64_t begin;
  int64_t end;
};
CHIMERA_HD Range twoshot_range(int rank, int n_ranks, int64_t n_vecs) {
  const int64_t base = n_vecs / n_ranks, extra = n_vecs % n_ranks;
  const int64_t begin = rank * base + (rank < extra ? rank : extra);
  return Range{begin, begin + base + (rank < extra ? 1 : 0)};
}
// Where rank `src` pushes its part of rank `dst`'s shares: region src < dst ? src : src - 1 of dst's staging
// buffer, [n_ranks - 1][max message] (a rank never pushes to itself: it reads its own part from its input).
CHIMERA_HD int twoshot_staging_region(int src, int dst) { return src < dst ? src : src - 1; }
// Which rank reduces vector v of a row of n_vecs (the inverse of twoshot_range).
CHIMERA_HD int twoshot_owner(int64_t v, int n_ranks, int64_t n_vecs) {
  const int64_t base = n_vecs / n_ranks, extra = n_vecs % n_ranks;
  const int64_t split = extra * (base + 1);  // vectors owned by the ranks with one extra
  if (v < split) return static_cast<int>(v / (base + 1));
  return static_cast<int>(extra + (v - split) / base);
}
// Rows are dealt to blocks round-robin (row t -> block t % n_blocks) by every kernel and every rank; the grid
// is a function of the shape only (never of the device), so block b handles the same rows on every rank.
inline constexpr int kMaxBlocks = 128;  // <= the SMs of an H100/H200: all blocks co-resident (barriers, spins)
CHIMERA_HD int grid_blocks(int64_t tokens) { return tokens < kMaxBlocks ? static_cast<int>(tokens) : kMaxBlocks; }

// ONESHOT kernel: the grid is kOneShotGrid blocks whatever the shape, so
// block b runs in every call and can keep its own Lamport slot counter (no cross-block atomics). Block b pushes
// the contiguous chunk oneshot_chunk(b, ...) of the message (in vectors) into region [slot][rank] of every rank,
// and in the next call clears the same chunk, recomputed from the total it recorded for that slot, of every
// source region of its own buffer: every rank's block b pushed exactly that chunk (same shape, same grid), so
// the union over blocks is the message's whole clear extent (lamport_clear_elems), whatever the sizes of
// consecutive calls.
inline constexpr int kOneShotGrid = kMaxBlocks;
CHIMERA_HD Range oneshot_chunk(int block, int grid, int64_t total_vecs) {
  const int64_t chunk = (total_vecs + grid - 1) / grid;
  const int64_t begin = block * chunk < total_vecs ? block * chunk : total_vecs;
  const int64_t end = begin + chunk < total_vecs ? begin + chunk : total_vecs;
  return Range{begin, end};
}

// Wrap-safe "flag has reached epoch" for the barrier flags (uint32 epochs, a peer can be one barrier ahead).
CHIMERA_HD bool epoch_reached(uint32_t flag, uint32_t epoch) { return static_cast<int32_t>(flag - epoch) >= 0; }

// ---- lookup-table keys --------------------------------------------------------------------------------
// ranks 2 -> 0, 4 -> 1, 8 -> 2 (others: -1).
CHIMERA_HD int ranks_index(int n_ranks) {
  return n_ranks == 2 ? 0 : n_ranks == 4 ? 1 : n_ranks == 8 ? 2 : -1;
}
// The table is keyed by the sizes the sweep measured (the lists live in the generated table,
// src/dist/sm90_allreduce_table.inc, so the sweep and the lookup read the same ones):
// hidden -> the row of the NEAREST measured hidden on a log scale (an exact row for every measured size, e.g. the
// models' 2688, 4096, 4480, 8192; between two rows the one whose ratio to `hidden` is smaller, the larger on a
// tie; clamped to the first / last row);
CHIMERA_HD int table_hidden_index(const int64_t* hidden_list, int n, int64_t hidden) {
  if (hidden > (int64_t{1} << 31)) hidden = int64_t{1} << 31;  // no overflow in the square below
  int i = 0;
  // Closer to list[i + 1] than to list[i] on a log scale <=> hidden^2 >= list[i] * list[i + 1].
  while (i + 1 < n && hidden * hidden >= hidden_list[i] * hidden_list[i + 1]) ++i;
  return i;
}
// tokens -> the column of the SMALLEST measured token count >= tokens (column j covers (t[j-1], t[j]]: a call is
// timed at the top of its range), clamped to the last column.
CHIMERA_HD int table_tokens_index(const int64_t* tokens_list, int n, int64_t tokens) {
  int j = 0;
  while (j + 1 < n && tokens > tokens_list[j]) ++j;
  return j;
}

}  // namespace chimera::dist
