// Paged causal GQA attention: prefill, chunked prefill and decode steps against a naive full-history oracle,
// on every backend (CPU: F32; CUDA: F32, BF16, F16 with the KV cache in the activation dtype).
// The CUDA-only cases use awkward sizes (tokens 1..4099, decode batches of 1..64 with contexts
// up to 8K, odd head counts, head_dim 16 / 64 / 128, block sizes 16 / 64) and check a sample of rows each.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#include "core/parallel.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/cuda_ops.h"
#endif

namespace chimera {
namespace {

using test::BackendTest;

struct AttnCase {
  int64_t Qh, KVh, hd;
};

// The values a kernel in `dtype` actually sees (inputs rounded to bf16 / f16, back in f32).
Tensor rounded(const Tensor& f32, DType dtype) {
  return dtype == DType::kF32 ? f32 : test::cast_to(f32, dtype).to_f32();
}

// Fresh random inputs of unit variance (uniform on [-sqrt(3), sqrt(3)), never zero), seeded from the test's
// Rng; splitmix64 is far cheaper than std::normal_distribution and the CUDA cases need tens of millions.
Tensor random_tensor(test::Rng& rng, Shape shape) {
  Tensor t = Tensor::empty(DType::kF32, std::move(shape));
  uint64_t state = rng.engine()();
  float* p = t.f32();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = (float(z >> 40) + 0.5f) * (3.4641016f / 16777216.0f) - 1.7320508f;
  }
  return t;
}

// Naive attention of one query row at position `pos` over positions [0, pos] of k, v [L, KVh, hd], in double.
//   q: [Qh, hd] (the row); out: [Qh, hd].
void naive_row(const float* q, const Tensor& k, const Tensor& v, int64_t pos, int64_t Qh, float scale, float* out) {
  const int64_t KVh = k.dim(1), hd = k.dim(2);
  const float* kp = k.f32();
  const float* vp = v.f32();
  std::vector<double> s(static_cast<size_t>(pos + 1)), acc(static_cast<size_t>(hd));
  for (int64_t j = 0; j < Qh; ++j) {
    const int64_t kh = j / (Qh / KVh);
    for (int64_t u = 0; u <= pos; ++u) {
      double d = 0;
      const float* kr = kp + (u * KVh + kh) * hd;
      for (int64_t e = 0; e < hd; ++e) d += double(q[j * hd + e]) * kr[e];
      s[u] = d * scale;
    }
    const double m = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - m));
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t u = 0; u <= pos; ++u) {
      const float* vr = vp + (u * KVh + kh) * hd;
      for (int64_t e = 0; e < hd; ++e) acc[e] += s[u] * vr[e];
    }
    for (int64_t e = 0; e < hd; ++e) out[j * hd + e] = float(acc[e] / sum);
  }
}

// Shuffled block ids, so a sequence's blocks are neither contiguous nor in order. Sequence s owns
// ceil(lens[s] / block_size) + 1 blocks (one spare); two more blocks belong to nobody, and the table columns
// past a sequence's own point at one of those (kernels must never touch them: they stay NaN).
struct PagedLayout {
  int64_t max_blocks = 0, num_blocks = 0, owned = 0;
  std::vector<int32_t> ids;
  Tensor tables;  // host [S, max_blocks] I32
};
PagedLayout make_layout(test::Rng& rng, const std::vector<int32_t>& lens, int64_t block_size) {
  PagedLayout l;
  for (int32_t n : lens) {
    const int64_t own = (n + block_size - 1) / block_size + 1;
    l.max_blocks = std::max(l.max_blocks, own);
    l.owned += own;
  }
  const int64_t S = int64_t(lens.size());
  l.num_blocks = l.owned + 2;
  l.ids.resize(static_cast<size_t>(l.num_blocks));
  std::iota(l.ids.begin(), l.ids.end(), 0);
  std::shuffle(l.ids.begin(), l.ids.end(), rng.engine());
  std::vector<int32_t> table(static_cast<size_t>(S * l.max_blocks), l.ids.back());
  size_t next = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t own = (lens[size_t(s)] + block_size - 1) / block_size + 1;
    for (int64_t b = 0; b < own; ++b) table[size_t(s * l.max_blocks + b)] = l.ids[next++];
  }
  l.tables = Tensor::from_i32({S, l.max_blocks}, table);
  return l;
}

class OpsAttention : public BackendTest {
 protected:
  struct Seqs {
    // Per sequence, host F32 already rounded to the dtype under test: k, v at positions [0, n); q at
    // positions [q_first, n) (decode cases only need the last query).
    std::vector<Tensor> q, k, v;
    std::vector<int64_t> q_first;
  };
  Seqs make_seqs(test::Rng& rng, const AttnCase& c, const std::vector<int32_t>& lens, DType dtype,
                 const std::vector<int32_t>& q_first = {}) const {
    Seqs d;
    for (size_t s = 0; s < lens.size(); ++s) {
      const int32_t n = lens[s], q0 = q_first.empty() ? 0 : q_first[s];
      d.q_first.push_back(q0);
      d.q.push_back(rounded(random_tensor(rng, {n - q0, c.Qh, c.hd}), dtype));
      d.k.push_back(rounded(random_tensor(rng, {n, c.KVh, c.hd}), dtype));
      d.v.push_back(rounded(random_tensor(rng, {n, c.KVh, c.hd}), dtype));
    }
    return d;
  }

  // Compares rows `rows` (indices into this step's batch; empty: every row) of `out` with the oracle.
  // row_seq / row_pos: the sequence and position of each batch row.
  void check_rows(const Tensor& out, const Seqs& d, const AttnCase& c, const std::vector<int64_t>& row_seq,
                  const std::vector<int64_t>& row_pos, std::vector<int64_t> rows, DType dtype) const {
    if (rows.empty()) {
      rows.resize(row_seq.size());
      std::iota(rows.begin(), rows.end(), 0);
    }
    const float scale = 1.0f / std::sqrt(float(c.hd));
    const int64_t R = int64_t(rows.size()), width = c.Qh * c.hd;
    const Tensor all = host_f32(out);
    Tensor got = Tensor::empty(DType::kF32, {R, c.Qh, c.hd}), want = Tensor::empty(DType::kF32, {R, c.Qh, c.hd});
    parallel_for(R, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = rows[size_t(i)], s = row_seq[size_t(r)], pos = row_pos[size_t(r)];
        std::copy_n(all.f32() + r * width, width, got.f32() + i * width);
        const float* qrow = d.q[size_t(s)].f32() + (pos - d.q_first[size_t(s)]) * width;
        naive_row(qrow, d.k[size_t(s)], d.v[size_t(s)], pos, c.Qh, scale, want.f32() + i * width);
      }
    });
    if (dtype == DType::kF32) {
      EXPECT_TRUE(test::nmse_close(got, want, test::kF32ReductionNmse, test::kF32Reduction));
    } else {
      EXPECT_TRUE(test::nmse_close(got, want, test::kBF16ReductionNmse, test::kBF16Elementwise));
    }
  }

  // The cache holds every sequence's k, v at positions [0, done[s]) (bit-exact copies) and the blocks no
  // sequence owns are untouched (still NaN).
  void check_cache(const ops::KvCacheView& cache, const Seqs& d, const PagedLayout& l, const std::vector<int32_t>& done,
                   int64_t block_size) const {
    const Tensor ck = host_f32(cache.k), cv = host_f32(cache.v);
    for (size_t s = 0; s < done.size(); ++s) {
      for (int32_t pos = 0; pos < done[s]; ++pos) {
        const int64_t blk = l.tables.i32()[int64_t(s) * l.max_blocks + pos / block_size];
        const int64_t off = pos % block_size;
        ASSERT_TRUE(test::bit_equal(ck.select(blk).select(off), d.k[s].select(pos))) << "seq " << s << " pos " << pos;
        ASSERT_TRUE(test::bit_equal(cv.select(blk).select(off), d.v[s].select(pos))) << "seq " << s << " pos " << pos;
      }
    }
    for (int64_t b = l.owned; b < l.num_blocks; ++b) {
      for (const Tensor* c : {&ck, &cv}) {
        const Tensor blk = c->select(l.ids[size_t(b)]);
        const int64_t written = std::count_if(blk.f32(), blk.f32() + blk.numel(), [](float x) { return !std::isnan(x); });
        EXPECT_EQ(written, 0) << "unowned block " << l.ids[size_t(b)] << " was written";
      }
    }
  }

  // Sequences of total lengths `lens` are fed in steps; step r gives sequence s `steps[r][s]` new tokens.
  // Every step's output rows (or `sample` of them: first and last of each sequence plus random ones) must
  // equal the naive full-history causal attention at those positions.
  void run_steps(test::Rng& rng, const AttnCase& c, const std::vector<int32_t>& lens,
                 const std::vector<std::vector<int32_t>>& steps, int64_t block_size, DType dtype = DType::kF32,
                 int sample = 0) const {
    const size_t S = lens.size();
    const float scale = 1.0f / std::sqrt(float(c.hd));
    const Seqs d = make_seqs(rng, c, lens, dtype);
    const PagedLayout l = make_layout(rng, lens, block_size);
    const Tensor tables = on_backend(l.tables);
    ops::KvCacheView cache{output(dtype, {l.num_blocks, block_size, c.KVh, c.hd}),
                           output(dtype, {l.num_blocks, block_size, c.KVh, c.hd})};

    std::vector<int32_t> done(S, 0);
    for (const auto& step : steps) {
      std::vector<int32_t> cu = {0};
      for (int32_t n : step) cu.push_back(cu.back() + n);
      const int64_t T = cu.back();
      Tensor qs = Tensor::empty(DType::kF32, {T, c.Qh, c.hd}), ks = Tensor::empty(DType::kF32, {T, c.KVh, c.hd});
      Tensor vs = Tensor::empty(DType::kF32, {T, c.KVh, c.hd});
      std::vector<int64_t> row_seq(static_cast<size_t>(T)), row_pos(static_cast<size_t>(T)), rows;
      for (size_t s = 0; s < S; ++s) {
        for (int32_t i = 0; i < step[s]; ++i) {
          const int64_t r = cu[s] + i, pos = done[s] + i;
          std::copy_n(d.q[s].select(pos).f32(), c.Qh * c.hd, qs.select(r).f32());
          std::copy_n(d.k[s].select(pos).f32(), c.KVh * c.hd, ks.select(r).f32());
          std::copy_n(d.v[s].select(pos).f32(), c.KVh * c.hd, vs.select(r).f32());
          row_seq[size_t(r)] = int64_t(s);
          row_pos[size_t(r)] = pos;
        }
        if (sample > 0 && step[s] > 0) {
          rows.push_back(cu[s]);
          rows.push_back(cu[s + 1] - 1);
        }
      }
      for (int i = 0; sample > 0 && T > 0 && i < sample; ++i) rows.push_back(rng.integer(0, T - 1));
      Tensor out = output(dtype, {T, c.Qh, c.hd});
      ops::attention(ctx(), out, on_backend(qs, dtype), on_backend(ks, dtype), on_backend(vs, dtype), cache, cu,
                     done, tables, scale);
      if (T > 0) check_rows(out, d, c, row_seq, row_pos, rows, dtype);
      for (size_t s = 0; s < S; ++s) done[s] += step[s];
    }
    check_cache(cache, d, l, done, block_size);
  }

  // The paged cache on the host (poisoned) holding positions [0, ctx_lens[s]) of every sequence's k and v.
  struct HostKv {
    Tensor k, v;
  };
  static HostKv host_cache(const Seqs& d, const AttnCase& c, const PagedLayout& l,
                           const std::vector<int32_t>& ctx_lens, int64_t block_size) {
    HostKv h{Tensor::empty(DType::kF32, {l.num_blocks, block_size, c.KVh, c.hd}), Tensor{}};
    h.v = Tensor::empty(DType::kF32, h.k.shape());
    test::poison(h.k);
    test::poison(h.v);
    for (size_t s = 0; s < ctx_lens.size(); ++s) {
      for (int32_t pos = 0; pos < ctx_lens[s]; ++pos) {
        const int64_t blk = l.tables.i32()[int64_t(s) * l.max_blocks + pos / block_size];
        std::copy_n(d.k[s].select(pos).f32(), c.KVh * c.hd, h.k.select(blk).select(pos % block_size).f32());
        std::copy_n(d.v[s].select(pos).f32(), c.KVh * c.hd, h.v.select(blk).select(pos % block_size).f32());
      }
    }
    return h;
  }

  // cu_seqlens / context_lens as ops::Indices over the caller's vectors, with device copies when device_meta (a
  // captured step's inputs; kept alive here).
  struct StepMeta {
    Tensor cu_dev, ctx_dev;
    ops::Indices cu, ctx;
  };
  StepMeta step_meta(const std::vector<int32_t>& cu, const std::vector<int32_t>& ctx_lens, bool device_meta) const {
    StepMeta m{Tensor{}, Tensor{}, ops::Indices(cu), ops::Indices(ctx_lens)};
    if (device_meta) {
      m.cu_dev = on_backend(Tensor::from_i32({int64_t(cu.size())}, cu));
      m.ctx_dev = on_backend(Tensor::from_i32({int64_t(ctx_lens.size())}, ctx_lens));
      m.cu = ops::Indices(cu, m.cu_dev.i32());
      m.ctx = ops::Indices(ctx_lens, m.ctx_dev.i32());
    }
    return m;
  }

  // One decode step (one new token per sequence) over caches of ctx_lens tokens written from the host.
  // device_meta: cu_seqlens / context_lens also on the device (a captured step's inputs), so the split plan is
  // sized for the block table's capacity and each sequence's CTAs past its own split count exit.
  void run_decode(test::Rng& rng, const AttnCase& c, const std::vector<int32_t>& ctx_lens, int64_t block_size,
                  DType dtype, bool device_meta = false) const {
    const size_t S = ctx_lens.size();
    std::vector<int32_t> lens(S);
    for (size_t s = 0; s < S; ++s) lens[s] = ctx_lens[s] + 1;
    const Seqs d = make_seqs(rng, c, lens, dtype, ctx_lens);
    const PagedLayout l = make_layout(rng, lens, block_size);
    const HostKv h = host_cache(d, c, l, ctx_lens, block_size);
    ops::KvCacheView cache{on_backend(h.k, dtype), on_backend(h.v, dtype)};
    const int64_t T = int64_t(S);
    Tensor qs = Tensor::empty(DType::kF32, {T, c.Qh, c.hd}), ks = Tensor::empty(DType::kF32, {T, c.KVh, c.hd});
    Tensor vs = Tensor::empty(DType::kF32, {T, c.KVh, c.hd});
    std::vector<int32_t> cu = {0};
    std::vector<int64_t> row_seq(S), row_pos(S);
    for (size_t s = 0; s < S; ++s) {
      std::copy_n(d.q[s].select(0).f32(), c.Qh * c.hd, qs.select(int64_t(s)).f32());
      std::copy_n(d.k[s].select(ctx_lens[s]).f32(), c.KVh * c.hd, ks.select(int64_t(s)).f32());
      std::copy_n(d.v[s].select(ctx_lens[s]).f32(), c.KVh * c.hd, vs.select(int64_t(s)).f32());
      cu.push_back(cu.back() + 1);
      row_seq[s] = int64_t(s);
      row_pos[s] = ctx_lens[s];
    }
    Tensor out = output(dtype, {T, c.Qh, c.hd});
    const StepMeta m = step_meta(cu, ctx_lens, device_meta);
    ops::attention(ctx(), out, on_backend(qs, dtype), on_backend(ks, dtype), on_backend(vs, dtype), cache, m.cu,
                   m.ctx, on_backend(l.tables), 1.0f / std::sqrt(float(c.hd)));
    check_rows(out, d, c, row_seq, row_pos, {}, dtype);
    check_cache(cache, d, l, lens, block_size);
  }

  // One decode step in which sequence s gets n_new[s] (0: idle, or 1) tokens over a cache of ctx_lens[s] tokens
  // written from the host. On CUDA twice from the same fresh cache: the append folded into the split-KV decode
  // kernel (the default) and as its own launch (KernelConfig::attention_decode_append off). Each run: output
  // poisoned, then against the oracle; the cache holds every appended row bit-exact, an idle sequence's row ctx_len
  // and the unowned blocks are untouched. Then the two runs' outputs and caches must be bit-identical.
  void run_decode_append(test::Rng& rng, const AttnCase& c, const std::vector<int32_t>& ctx_lens,
                         const std::vector<int32_t>& n_new, int64_t block_size, DType dtype, bool device_meta) const {
    const size_t S = ctx_lens.size();
    std::vector<int32_t> lens(S), done(S);
    for (size_t s = 0; s < S; ++s) {
      lens[s] = ctx_lens[s] + 1;  // data for position ctx_len even where it is not appended (idle)
      done[s] = ctx_lens[s] + n_new[s];
    }
    const Seqs d = make_seqs(rng, c, lens, dtype, ctx_lens);
    const PagedLayout l = make_layout(rng, lens, block_size);
    const HostKv h = host_cache(d, c, l, ctx_lens, block_size);
    std::vector<int32_t> cu = {0};
    std::vector<int64_t> row_seq, row_pos;
    for (size_t s = 0; s < S; ++s) {
      cu.push_back(cu.back() + n_new[s]);
      if (n_new[s] > 0) {
        row_seq.push_back(int64_t(s));
        row_pos.push_back(ctx_lens[s]);
      }
    }
    const int64_t T = cu.back();
    Tensor qs = Tensor::empty(DType::kF32, {T, c.Qh, c.hd}), ks = Tensor::empty(DType::kF32, {T, c.KVh, c.hd});
    Tensor vs = Tensor::empty(DType::kF32, {T, c.KVh, c.hd});
    for (int64_t r = 0; r < T; ++r) {
      const size_t s = size_t(row_seq[size_t(r)]);
      std::copy_n(d.q[s].select(0).f32(), c.Qh * c.hd, qs.select(r).f32());
      std::copy_n(d.k[s].select(ctx_lens[s]).f32(), c.KVh * c.hd, ks.select(r).f32());
      std::copy_n(d.v[s].select(ctx_lens[s]).f32(), c.KVh * c.hd, vs.select(r).f32());
    }
    const Tensor q = on_backend(qs, dtype), k = on_backend(ks, dtype), v = on_backend(vs, dtype);
    const Tensor tables = on_backend(l.tables);
    const StepMeta m = step_meta(cu, ctx_lens, device_meta);
    std::vector<bool> folds = {true};  // CPU: one path
    if (on_cuda()) folds = {true, false};
    std::vector<Tensor> outs, caches_k, caches_v;
    for (const bool fold : folds) {
      SCOPED_TRACE(::testing::Message() << (fold ? "append folded into decode" : "append launch"));
      ops::KvCacheView cache{on_backend(h.k, dtype), on_backend(h.v, dtype)};
      Tensor out = output(dtype, {T, c.Qh, c.hd});
      ops::Context run_ctx = ctx();
      run_ctx.kernels.attention_decode_append = fold;
      ops::attention(run_ctx, out, q, k, v, cache, m.cu, m.ctx, tables, 1.0f / std::sqrt(float(c.hd)));
      check_rows(out, d, c, row_seq, row_pos, {}, dtype);
      check_cache(cache, d, l, done, block_size);
      const Tensor ck = host_f32(cache.k), cv = host_f32(cache.v);
      for (size_t s = 0; s < S; ++s) {
        if (n_new[s] > 0) continue;
        const int32_t pos = ctx_lens[s];
        const int64_t blk = l.tables.i32()[int64_t(s) * l.max_blocks + pos / block_size];
        for (const Tensor* t : {&ck, &cv}) {
          const Tensor row = t->select(blk).select(pos % block_size);
          EXPECT_TRUE(std::all_of(row.f32(), row.f32() + row.numel(), [](float x) { return std::isnan(x); }))
              << "idle sequence " << s << ": row " << pos << " was written";
        }
      }
      outs.push_back(host_f32(out));
      caches_k.push_back(ck);
      caches_v.push_back(cv);
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      EXPECT_TRUE(test::bit_equal(outs[i], outs[0])) << "output: append launch vs folded";
      EXPECT_TRUE(test::bit_equal(caches_k[i], caches_k[0])) << "k cache: append launch vs folded";
      EXPECT_TRUE(test::bit_equal(caches_v[i], caches_v[0])) << "v cache: append launch vs folded";
    }
  }
};

// The decode step's append folded into the split-KV decode kernel (attention_decode.cu), against the oracle and
// bit-identical to the append as its own launch. New rows at positions 0, 1, 63, 64, 65, 127 (first / last row of
// a 64-key tile), 1000, 1024, 1031 (one 64-key split each: the appending CTA is the last of ~17); two idle
// sequences (one between, one last); block sizes 1, 8, 64 put position ctx_len at a page start or end; GQA groups
// 1, 4, 16 with head_dim 64 and 128. CUDA: BF16 and F16 (the decode path), eager (host sequence table) and with
// device-side metadata (a captured step: AttnSeq built in the kernels, splits planned for the table's capacity),
// and F32 (the generic kernel after the append launch). CPU: F32.
TEST_P(OpsAttention, DecodeAppendFoldedAwkwardContexts) {
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> ctx_lens = {0, 1, 63, 300, 64, 65, 127, 1000, 1024, 1031, 0};
  const std::vector<int32_t> n_new = {1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0};
  std::vector<DType> dtypes = {DType::kF32};
  if (on_cuda()) dtypes = {DType::kBF16, DType::kF16, DType::kF32};
  for (const AttnCase& c : {AttnCase{2, 2, 64}, AttnCase{8, 2, 128}, AttnCase{16, 1, 64}, AttnCase{32, 2, 128}}) {
    for (const int64_t block_size : {1, 8, 64}) {
      for (const DType dtype : dtypes) {
        for (const bool device_meta : {false, true}) {
          if (device_meta && !on_cuda()) continue;
          SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " Qh=" << c.Qh << " KVh=" << c.KVh << " hd=" << c.hd
                                            << " bs=" << block_size << (device_meta ? " device metadata" : " eager"));
          run_decode_append(rng, c, ctx_lens, n_new, block_size, dtype, device_meta);
        }
      }
    }
  }
}

// Batch 1 (the Nano decode step: 32 q heads, 2 kv heads, head_dim 128) at tile and split boundaries, eager and
// captured-style, and one idle sequence next to a single active one.
TEST_P(OpsAttention, DecodeAppendFoldedBatch1) {
  auto rng = test::Rng::for_test();
  const DType dtype = on_cuda() ? DType::kBF16 : DType::kF32;
  for (const int32_t ctx_len : {0, 63, 64, 1023, 1024, 4095, 8191}) {
    for (const bool device_meta : {false, true}) {
      if (device_meta && !on_cuda()) continue;
      SCOPED_TRACE(::testing::Message() << "ctx " << ctx_len << (device_meta ? " device metadata" : " eager"));
      run_decode_append(rng, {32, 2, 128}, {ctx_len}, {1}, 64, dtype, device_meta);
      run_decode_append(rng, {32, 2, 128}, {ctx_len, 17}, {0, 1}, 16, dtype, device_meta);
    }
  }
}

const AttnCase kCases[] = {{6, 2, 20}, {5, 5, 33}, {3, 1, 8}, {8, 2, 128}};

TEST_P(OpsAttention, PrefillMatchesNaive) {
  auto rng = test::Rng::for_test();
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    if (dtype != DType::kF32 && !on_cuda()) continue;
    for (const AttnCase& c : kCases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " Qh=" << c.Qh << " KVh=" << c.KVh << " hd=" << c.hd);
      const std::vector<int32_t> lens = {1, 17, 5};
      run_steps(rng, c, lens, {lens}, 4, dtype);
    }
  }
}

TEST_P(OpsAttention, ChunkedPrefillThenDecodeEqualsFullAttention) {
  auto rng = test::Rng::for_test();
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    if (dtype != DType::kF32 && !on_cuda()) continue;
    for (const AttnCase& c : kCases) {
      for (int64_t block_size : {1, 4, 16}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " Qh=" << c.Qh << " KVh=" << c.KVh << " hd=" << c.hd
                                          << " bs=" << block_size);
        // Two chunked-prefill steps (one sequence idle in the second), then three decode steps.
        const std::vector<int32_t> lens = {12, 25, 4};
        run_steps(rng, c, lens, {{7, 19, 1}, {2, 3, 0}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}}, block_size, dtype);
      }
    }
  }
}

TEST_P(OpsAttention, BadShapesThrowNamingTheOp) {
  const Tensor q = on_backend(Tensor::zeros(DType::kF32, {3, 4, 8}));
  const Tensor kv = on_backend(Tensor::zeros(DType::kF32, {3, 3, 8}));
  Tensor out = output(DType::kF32, {3, 4, 8});
  ops::KvCacheView cache{on_backend(Tensor::zeros(DType::kF32, {2, 4, 3, 8})),
                         on_backend(Tensor::zeros(DType::kF32, {2, 4, 3, 8}))};
  const Tensor tables = on_backend(Tensor::from_i32({1, 1}, std::vector<int32_t>{0}));
  const std::vector<int32_t> cu = {0, 3}, ctx_lens = {0};
  EXPECT_TRUE(test::throws_error([&] { ops::attention(ctx(), out, q, kv, kv, cache, cu, ctx_lens, tables, 1.0f); },
                                 ErrorKind::kRuntime, "ops::attention: k F32[3, 3, 8] has 3 heads"));
  const Tensor kv2 = on_backend(Tensor::zeros(DType::kF32, {3, 2, 8}));
  ops::KvCacheView cache2{on_backend(Tensor::zeros(DType::kF32, {2, 4, 2, 8})),
                          on_backend(Tensor::zeros(DType::kF32, {2, 4, 2, 8}))};
  EXPECT_TRUE(test::throws_error(
      [&] { ops::attention(ctx(), out, q, kv2, kv2, cache2, cu, std::vector<int32_t>{2}, tables, 1.0f); },
      ErrorKind::kRuntime, "ops::attention: sequence 0 needs 5 positions"));
  // Block ids are only checked where the table is readable (a host table: the CPU backend).
  if (!on_cuda()) {
    const Tensor bad_tables = Tensor::from_i32({1, 1}, std::vector<int32_t>{2});
    EXPECT_TRUE(
        test::throws_error([&] { ops::attention(ctx(), out, q, kv2, kv2, cache2, cu, ctx_lens, bad_tables, 1.0f); },
                           ErrorKind::kRuntime, "ops::attention: block_tables[0, 0] = 2 is out of range for 2 blocks"));
  }
}

// ---- CUDA: the awkward sizes (the CPU reference would take minutes on them) -----------------------------

// One varlen prefill batch with the awkward token counts 1, 3, 17, 111, 989, 4099 (5220 rows).
TEST_P(OpsAttention, CudaPrefillAwkwardTokensNanoHeadsBf16) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {1, 3, 17, 111, 989, 4099};
  run_steps(rng, {32, 2, 128}, lens, {lens}, 16, DType::kBF16, 48);
}

TEST_P(OpsAttention, CudaPrefillAwkwardTokensNanoHeadsF32) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {4099, 1, 989, 3, 111, 17};
  run_steps(rng, {32, 2, 128}, lens, {lens}, 64, DType::kF32, 48);
}

TEST_P(OpsAttention, CudaPrefillAwkwardTokensHd64AndF16) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {989, 1, 3, 17, 111, 4099};
  run_steps(rng, {32, 8, 64}, lens, {lens}, 64, DType::kBF16, 32);
  run_steps(rng, {40, 8, 128}, {111, 989, 17}, {{111, 989, 17}}, 16, DType::kF16, 32);
}

TEST_P(OpsAttention, CudaPrefillOddHeadsAndSmallHeadDims) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  const std::vector<int32_t> lens = {3, 989, 1, 17, 111};
  for (const AttnCase& c : {AttnCase{5, 1, 64}, AttnCase{5, 1, 16}, AttnCase{5, 1, 128}, AttnCase{6, 2, 32}}) {
    for (const DType dtype : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " Qh=" << c.Qh << " KVh=" << c.KVh << " hd=" << c.hd);
      run_steps(rng, c, lens, {lens}, c.hd == 16 ? 64 : 16, dtype, 32);
    }
  }
}

// Chunked prefill on top of a cache: step 2 adds chunks to contexts of 2900, 600 and 1 tokens, next to a
// decode row and an idle sequence; prompts cross many 64-row tiles and cache blocks.
const std::vector<int32_t> kChunkLens = {3000, 700, 129, 2, 64};
const std::vector<std::vector<int32_t>> kChunkSteps = {{2900, 600, 1, 1, 64}, {100, 100, 128, 1, 0}};

TEST_P(OpsAttention, CudaChunkedPrefillOnTopOfCacheBf16) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  run_steps(rng, {32, 2, 128}, kChunkLens, kChunkSteps, 16, DType::kBF16, 40);
}

TEST_P(OpsAttention, CudaChunkedPrefillOnTopOfCacheF16Hd64AndF32) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  run_steps(rng, {32, 8, 64}, kChunkLens, kChunkSteps, 64, DType::kF16, 40);
  run_steps(rng, {32, 2, 128}, kChunkLens, kChunkSteps, 64, DType::kF32, 40);
}

// Decode batches of 1 to 64 sequences with mixed context lengths up to 8K (split-KV kernel + combine).
std::vector<int32_t> random_lens(test::Rng& rng, int n, int64_t lo, int64_t hi) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = int32_t(rng.integer(lo, hi));
  return v;
}

TEST_P(OpsAttention, CudaDecodeNanoHeadsBatch1And8) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  run_decode(rng, {32, 2, 128}, {8191}, 64, DType::kBF16);
  run_decode(rng, {32, 2, 128}, random_lens(rng, 8, 1, 8192), 16, DType::kBF16);
}

// The split merge: fused into the decode kernel (last split of each (sequence, kv head), ticket) up to 32 splits,
// the combine kernel beyond (attention_decode.cu, kFuseMaxSplits). Batch 1 at 1K (16 splits) twice in a row: the
// ticket words must be back at zero; 32 and 33 splits (2047 / 2048 cached tokens): both sides of the bound; ~470
// splits of a 64-dim head; mixed lengths and a group of 4 (MMA rows 4..15 unused).
TEST_P(OpsAttention, CudaDecodeSplitMergeFusedAndCombineKernel) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  for (int rep = 0; rep < 2; ++rep) run_decode(rng, {32, 2, 128}, {1023}, 64, DType::kBF16);
  run_decode(rng, {32, 2, 128}, {2047}, 64, DType::kBF16);
  run_decode(rng, {32, 2, 128}, {2048}, 16, DType::kBF16);
  run_decode(rng, {8, 1, 64}, {30001}, 64, DType::kBF16);
  run_decode(rng, {32, 2, 128}, {1024, 1, 1000}, 16, DType::kF16);
  run_decode(rng, {12, 3, 64}, random_lens(rng, 5, 0, 3000), 64, DType::kBF16);
}

// Device-side metadata (what a captured decode step passes): splits planned for the block table's capacity.
TEST_P(OpsAttention, CudaDecodeDeviceMetadata) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  run_decode(rng, {32, 2, 128}, {1023}, 64, DType::kBF16, true);
  run_decode(rng, {32, 2, 128}, {5000, 0, 77, 1024}, 16, DType::kBF16, true);
  run_decode(rng, {32, 8, 64}, random_lens(rng, 9, 0, 2000), 64, DType::kF16, true);
}

TEST_P(OpsAttention, CudaDecodeNanoHeadsBatch8F32) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  run_decode(rng, {32, 2, 128}, random_lens(rng, 8, 1, 8192), 64, DType::kF32);
}

TEST_P(OpsAttention, CudaDecodeNanoHeadsBatch64) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  std::vector<int32_t> lens = random_lens(rng, 64, 0, 1024);
  lens[5] = 8000;
  lens[40] = 4097;
  run_decode(rng, {32, 2, 128}, lens, 64, DType::kBF16);
}

TEST_P(OpsAttention, CudaDecodeEightKvHeads) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  run_decode(rng, {40, 8, 128}, random_lens(rng, 12, 0, 3000), 16, DType::kBF16);
  run_decode(rng, {32, 8, 64}, random_lens(rng, 33, 0, 1500), 64, DType::kBF16);
  run_decode(rng, {32, 8, 64}, random_lens(rng, 7, 0, 2000), 16, DType::kF16);
}

TEST_P(OpsAttention, CudaDecodeOddHeadsAndWideGroups) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA-only sizes";
  auto rng = test::Rng::for_test();
  run_decode(rng, {5, 1, 64}, random_lens(rng, 5, 0, 5000), 16, DType::kBF16);
  run_decode(rng, {5, 1, 16}, random_lens(rng, 3, 0, 3000), 64, DType::kBF16);
  run_decode(rng, {5, 1, 128}, random_lens(rng, 2, 0, 1500), 16, DType::kF32);
  run_decode(rng, {64, 2, 128}, random_lens(rng, 3, 0, 1000), 16, DType::kBF16);  // group 32: the prefill path
}

TEST_P(OpsAttention, CudaMixedDtypesThrow) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA only";
  const Tensor q = on_backend(Tensor::zeros(DType::kF32, {3, 4, 8}), DType::kBF16);
  const Tensor kv = on_backend(Tensor::zeros(DType::kF32, {3, 2, 8}), DType::kBF16);
  Tensor out = output(DType::kBF16, {3, 4, 8});
  ops::KvCacheView cache{output(DType::kF32, {2, 4, 2, 8}), output(DType::kF32, {2, 4, 2, 8})};
  const Tensor tables = on_backend(Tensor::from_i32({1, 1}, std::vector<int32_t>{0}));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::attention(ctx(), out, q, kv, kv, cache, std::vector<int32_t>{0, 3}, std::vector<int32_t>{0}, tables, 1.0f); },
      ErrorKind::kRuntime, "ops::attention: F32[2, 4, 2, 8] does not match q BF16[3, 4, 8]"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsAttention);

}  // namespace
}  // namespace chimera
