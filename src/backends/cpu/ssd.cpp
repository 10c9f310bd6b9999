// Mamba-2 selective state space: chunked SSD prefill (docs/model.md 3.4), the plain recurrence (3.3, the test
// oracle) and the single-token state update (3.5).
//
// ssd_chunk_scan mirrors mamba_ssm's mamba_chunk_scan_combined stage by stage so the CUDA port can be tested
// one stage at a time: chunk_cumsum -> chunk_state -> state_passing -> bmm_chunk -> chunk_scan.
// Chunks are taken within each sequence: the chunk grid restarts at every sequence start.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/cpu/cpu_common.h"
#include "backends/cpu/cpu_ops.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/stochastic_rounding.h"

namespace chimera::cpu {
namespace {

struct SsmDims {
  int64_t T, H, P, G, N;
  int64_t heads_per_group() const { return H / G; }
};

SsmDims ssm_dims(const Tensor& x, const Tensor& B) { return {x.dim(0), x.dim(1), x.dim(2), B.dim(1), B.dim(2)}; }

// dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), all fp32.
inline float discretize_dt(float raw, float bias, const ops::SsmParams& p) {
  return std::clamp(softplus(raw + bias), p.dt_min, p.dt_max);
}

std::vector<float> ssm_a(const ops::SsmParams& p) {
  std::vector<float> a = to_f32_vector(p.A_log);
  for (float& v : a) v = -std::exp(v);
  return a;
}

// One chunk: rows [begin, end) of the packed batch, belonging to sequence `seq`; the state entering it also goes to
// slot `checkpoint` (-1: none; ops::StateCheckpoint).
struct Chunk {
  int64_t seq, begin, end;
  int32_t checkpoint = -1;
};

// The state of one (slot, head) is [P, N] elements at element offset (slot * H + h) * P * N of ssm_state, of the
// state dtype (F32, BF16 or F16): read into fp32 once, written back once per call (ops.h SsmParams).
void load_state(const Tensor& state, int64_t offset, int64_t n, float* dst) {
  const auto* base = static_cast<const char*>(state.data()) + offset * static_cast<int64_t>(dtype_size(state.dtype()));
  convert_to_f32(base, state.dtype(), dst, static_cast<size_t>(n));
}

// Position of the token after which sequence s's state is written by this call: its last row's.
int64_t context_of(const ops::SsmParams& p, size_t s) {
  return p.context_lens.empty() ? 0 : static_cast<int64_t>(p.context_lens[s]);
}

// BF16: round to nearest even; F16: stochastic, element e0 + i of the slot with the bits of `position`.
void store_state(const Tensor& state, int64_t offset, int64_t n, const float* src, const ops::SsmParams& p,
                 int64_t position, int64_t e0) {
  switch (state.dtype()) {
    case DType::kF32:
      std::copy_n(src, n, state.f32() + offset);
      return;
    case DType::kBF16: {
      auto* dst = static_cast<uint16_t*>(state.data()) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* dst = static_cast<uint16_t*>(state.data()) + offset;
      const uint64_t key = ssm_rounding_key(p.state_seed, position);
      for (int64_t i = 0; i < n; ++i) {
        dst[i] = f32_to_f16_stochastic(src[i], ssm_rounding_bits(key, static_cast<uint32_t>(e0 + i)));
      }
      return;
    }
    default: runtime_error("ssm_state {} must be F32, BF16 or F16", state.describe());
  }
}

// Per-token recurrence step on one head's state S [P, N] (docs/model.md 3.3 / 3.5); writes y_row [P].
void recurrence_step(float* S, const float* x_row, const float* b, const float* c, float dt, float a, float d,
                     int64_t P, int64_t N, float* y_row) {
  const float dA = std::exp(dt * a);
  for (int64_t pi = 0; pi < P; ++pi) {
    float* s = S + pi * N;
    const float dtx = dt * x_row[pi];
    for (int64_t n = 0; n < N; ++n) s[n] = s[n] * dA + dtx * b[n];
    y_row[pi] = dot_f32(s, c, N) + d * x_row[pi];
  }
}

}  // namespace

void ssd_chunk_scan(const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
                    const ops::SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
                    std::span<const int32_t> slots, int64_t chunk_size,
                    std::span<const ops::StateCheckpoint> checkpoints) {
  const SsmDims d = ssm_dims(x, B);
  const int64_t H = d.H, P = d.P, G = d.G, N = d.N, hpg = d.heads_per_group(), Q = chunk_size;
  const std::vector<float> A = ssm_a(p), Dskip = to_f32_vector(p.D), dt_bias = to_f32_vector(p.dt_bias);
  const float* xp = x.f32();
  const float* Bp = B.f32();
  const float* Cp = C.f32();

  // The chunk grid, restarting at each (non-pad) sequence and at each checkpoint's cut; seq_chunks[s] = [first,
  // last) chunk of sequence s.
  std::vector<Chunk> chunks;
  std::vector<std::pair<int64_t, int64_t>> seq_chunks(slots.size());
  auto cp = checkpoints.begin();
  for (size_t s = 0; s < slots.size(); ++s) {
    seq_chunks[s].first = static_cast<int64_t>(chunks.size());
    if (slots[s] >= 0) {
      const int64_t end = cu_seqlens[s + 1];
      int64_t piece = cu_seqlens[s];
      int32_t entering = -1;  // the checkpoint slot of the piece starting at `piece`
      while (piece < end) {
        const bool cut = cp != checkpoints.end() && cp->seq == static_cast<int32_t>(s);
        const int64_t piece_end = cut ? cu_seqlens[s] + cp->rows : end;
        for (int64_t b = piece; b < piece_end; b += Q) {
          chunks.push_back(
              {static_cast<int64_t>(s), b, std::min<int64_t>(b + Q, piece_end), b == piece ? entering : -1});
        }
        piece = piece_end;
        entering = cut ? cp->slot : -1;
        if (cut) ++cp;
      }
    }
    seq_chunks[s].second = static_cast<int64_t>(chunks.size());
  }
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());

  // 1. chunk_cumsum: dt [T, H] after softplus/clamp; dA_cumsum [T, H] = cumsum of dt*A within the chunk.
  std::vector<float> dt(static_cast<size_t>(d.T * H)), dA_cumsum(static_cast<size_t>(d.T * H));
  parallel_for(n_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t ci = c0; ci < c1; ++ci) {
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int64_t t = chunks[ci].begin; t < chunks[ci].end; ++t) {
          const float v = discretize_dt(dt_raw.f32()[t * H + h], dt_bias[h], p);
          dt[t * H + h] = v;
          acc += v * A[h];
          dA_cumsum[t * H + h] = acc;
        }
      }
    }
  });

  // 2. chunk_state: each chunk's end state from a zero start,
  //    states[c, h] = sum_s exp(Acum[last] - Acum[s]) * dt[s] * outer(x[s, h], B[s, g])      [P, N]
  const int64_t state_size = P * N;
  std::vector<float> states(static_cast<size_t>(n_chunks * H * state_size), 0.0f);
  parallel_for(n_chunks * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t ci = i / H, h = i % H, g = h / hpg;
      const Chunk& ch = chunks[ci];
      const float a_last = dA_cumsum[(ch.end - 1) * H + h];
      float* S = states.data() + i * state_size;
      for (int64_t s = ch.begin; s < ch.end; ++s) {
        const float coef = std::exp(a_last - dA_cumsum[s * H + h]) * dt[s * H + h];
        const float* xs = xp + (s * H + h) * P;
        const float* bs = Bp + (s * G + g) * N;
        for (int64_t pi = 0; pi < P; ++pi) {
          const float cx = coef * xs[pi];
          float* Sp = S + pi * N;
          for (int64_t n = 0; n < N; ++n) Sp[n] += cx * bs[n];
        }
      }
    }
  });

  // 3. state_passing: S_in(0) = ssm_state[slot]; S_in(c+1) = exp(Acum_c[last]) * S_in(c) + states[c].
  //    states[c] is replaced by S_in(c) (the state entering chunk c); the final state goes back to the slot.
  const int64_t S_count = static_cast<int64_t>(slots.size());
  parallel_for(S_count * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> running(static_cast<size_t>(state_size));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / H, h = i % H;
      const int32_t slot = slots[static_cast<size_t>(s)];
      if (slot < 0) continue;
      const int64_t offset = (slot * H + h) * state_size;
      load_state(ssm_state, offset, state_size, running.data());
      for (int64_t ci = seq_chunks[s].first; ci < seq_chunks[s].second; ++ci) {
        if (const int32_t ck = chunks[ci].checkpoint; ck >= 0) {  // keyed by the row before the cut
          const int64_t before = context_of(p, static_cast<size_t>(s)) + chunks[ci].begin - cu_seqlens[s] - 1;
          store_state(ssm_state, (ck * H + h) * state_size, state_size, running.data(), p, before, h * state_size);
        }
        const float decay = std::exp(dA_cumsum[(chunks[ci].end - 1) * H + h]);
        float* st = states.data() + (ci * H + h) * state_size;
        for (int64_t e = 0; e < state_size; ++e) {
          const float in = running[e];
          running[e] = decay * in + st[e];
          st[e] = in;
        }
      }
      const int64_t last = context_of(p, static_cast<size_t>(s)) + cu_seqlens[s + 1] - cu_seqlens[s] - 1;
      store_state(ssm_state, offset, state_size, running.data(), p, last, h * state_size);
    }
  });

  // 4. bmm_chunk: CB[c, g, l, s] = C[l, g] . B[s, g] for s <= l within the chunk.
  std::vector<float> CB(static_cast<size_t>(n_chunks * G * Q * Q), 0.0f);
  parallel_for(n_chunks * G, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t ci = i / G, g = i % G;
      const Chunk& ch = chunks[ci];
      float* cb = CB.data() + i * Q * Q;
      for (int64_t l = 0; l < ch.end - ch.begin; ++l) {
        const float* cl = Cp + ((ch.begin + l) * G + g) * N;
        for (int64_t s = 0; s <= l; ++s) cb[l * Q + s] = dot_f32(cl, Bp + ((ch.begin + s) * G + g) * N, N);
      }
    }
  });

  // 5. chunk_scan: y[l] = exp(Acum[l]) * (S_in @ C[l])                                  (inter-chunk)
  //                     + sum_{s<=l} CB[l, s] * exp(Acum[l] - Acum[s]) * dt[s] * x[s]   (intra-chunk)
  //                     + D * x[l]
  parallel_for(n_chunks * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(static_cast<size_t>(P));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t ci = i / H, h = i % H, g = h / hpg;
      const Chunk& ch = chunks[ci];
      const float* S_in = states.data() + i * state_size;
      const float* cb = CB.data() + (ci * G + g) * Q * Q;
      for (int64_t l = 0; l < ch.end - ch.begin; ++l) {
        const int64_t t = ch.begin + l;
        const float a_l = dA_cumsum[t * H + h];
        const float* cl = Cp + (t * G + g) * N;
        const float decay_in = std::exp(a_l);
        for (int64_t pi = 0; pi < P; ++pi) acc[pi] = decay_in * dot_f32(S_in + pi * N, cl, N);
        for (int64_t s = 0; s <= l; ++s) {
          const int64_t ts = ch.begin + s;
          const float coef = cb[l * Q + s] * std::exp(a_l - dA_cumsum[ts * H + h]) * dt[ts * H + h];
          const float* xs = xp + (ts * H + h) * P;
          for (int64_t pi = 0; pi < P; ++pi) acc[pi] += coef * xs[pi];
        }
        const float* xl = xp + (t * H + h) * P;
        float* yl = y.f32() + (t * H + h) * P;
        for (int64_t pi = 0; pi < P; ++pi) yl[pi] = acc[pi] + Dskip[h] * xl[pi];
      }
    }
  });
}

void ssm_recurrence(const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
                    const ops::SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
                    std::span<const int32_t> slots) {
  const SsmDims d = ssm_dims(x, B);
  const int64_t H = d.H, P = d.P, G = d.G, N = d.N, hpg = d.heads_per_group();
  const std::vector<float> A = ssm_a(p), Dskip = to_f32_vector(p.D), dt_bias = to_f32_vector(p.dt_bias);
  const int64_t S_count = static_cast<int64_t>(slots.size());
  parallel_for(S_count * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> state(static_cast<size_t>(P * N));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / H, h = i % H, g = h / hpg;
      const int32_t slot = slots[static_cast<size_t>(s)];
      if (slot < 0) continue;
      float* S = state.data();
      const int64_t offset = (slot * H + h) * P * N;
      load_state(ssm_state, offset, P * N, S);
      const int64_t t0 = cu_seqlens[static_cast<size_t>(s)], t1 = cu_seqlens[static_cast<size_t>(s) + 1];
      for (int64_t t = t0; t < t1; ++t) {
        const float dt = discretize_dt(dt_raw.f32()[t * H + h], dt_bias[h], p);
        recurrence_step(S, x.f32() + (t * H + h) * P, B.f32() + (t * G + g) * N, C.f32() + (t * G + g) * N, dt, A[h],
                        Dskip[h], P, N, y.f32() + (t * H + h) * P);
      }
      store_state(ssm_state, offset, P * N, S, p, context_of(p, static_cast<size_t>(s)) + t1 - t0 - 1, h * P * N);
    }
  });
}

void selective_state_update(const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
                            const ops::SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> slots,
                            std::span<const int32_t> dst_slots) {
  const SsmDims d = ssm_dims(x, B);
  const int64_t H = d.H, P = d.P, G = d.G, N = d.N, hpg = d.heads_per_group();
  const std::vector<float> A = ssm_a(p), Dskip = to_f32_vector(p.D), dt_bias = to_f32_vector(p.dt_bias);
  const int64_t Bn = static_cast<int64_t>(slots.size());
  parallel_for(Bn * H, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> state(static_cast<size_t>(P * N));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H, g = h / hpg;
      const int32_t slot = slots[static_cast<size_t>(b)];
      if (slot < 0) continue;
      const float dt = discretize_dt(dt_raw.f32()[b * H + h], dt_bias[h], p);
      // Out of place: the source slot's state read, the same step, the result written to the destination (same bits).
      const int64_t dst = dst_slots.empty() ? slot : dst_slots[static_cast<size_t>(b)];
      load_state(ssm_state, (slot * H + h) * P * N, P * N, state.data());
      recurrence_step(state.data(), x.f32() + (b * H + h) * P, B.f32() + (b * G + g) * N, C.f32() + (b * G + g) * N,
                      dt, A[h], Dskip[h], P, N, y.f32() + (b * H + h) * P);
      store_state(ssm_state, (dst * H + h) * P * N, P * N, state.data(), p, context_of(p, static_cast<size_t>(b)),
                  h * P * N);
    }
  });
}

}  // namespace chimera::cpu
