// CUDA embedding and the RMSNorm family: Tensor -> params adapters (the kernels are in row_norm.cuh).
// Shapes and devices were validated by ops/ops.cpp; here: one activation dtype per call, sizes that fit
// the kernels' index types, and the host token ids uploaded to device scratch.
#include <limits>

#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/norm/row_norm.cuh"

namespace chimera::cuda {
namespace {

constexpr int kIdsScratchSlot = 0;

int checked_int(const char* op, const char* what, int64_t v) {
  if (v > std::numeric_limits<int>::max()) throw_runtime(str_cat(op, ": ", what, " ", v, " exceeds 2^31 - 1"));
  return static_cast<int>(v);
}

// ---- embedding -------------------------------------------------------------------------------------

struct EmbeddingParams {
  void* out;           // [T, D] TOut
  const void* table;   // [V, D] TIn
  const int32_t* ids;  // [T] device, validated in [0, V) on the host; null: row t of the table (ops::convert)
  int64_t tokens;
  int hidden;
  // A vocabulary shard (ops::embedding_shard): the table holds rows [first, first + rows) of the vocabulary; an id
  // outside them gives a zero row. rows 0: every id is a row of the table.
  int64_t first = 0;
  int64_t rows = 0;
};

// Blocks (token, chunk of kEmbedChunk accesses of N elements, 16-byte groups when D and the pointers allow). Long
// rows get several blocks, so that ops::convert of one 131072-wide logits row (the GPU sampler converts the lm_head
// row to fp32 in every decode step) is not left to one SM.
constexpr int kEmbedChunk = 1024;  // accesses per block: 256 threads x 4

template <typename TIn, typename TOut, int N>
__global__ void embedding_kernel(const EmbeddingParams p) {
  const int64_t t = blockIdx.x;
  pdl_wait();  // PDL: the ids (step metadata) and, for ops::convert, the table are earlier kernels' outputs
  pdl_trigger();
  const int64_t row = (p.ids ? p.ids[t] : t) - p.first;
  const bool zero = p.rows > 0 && (row < 0 || row >= p.rows);  // another shard's token
  const TIn* src =
      static_cast<const TIn*>(p.table) + static_cast<size_t>(zero ? 0 : row) * static_cast<size_t>(p.hidden);
  TOut* dst = static_cast<TOut*>(p.out) + static_cast<size_t>(t) * static_cast<size_t>(p.hidden);
  const int end = min(p.hidden / N, (static_cast<int>(blockIdx.y) + 1) * kEmbedChunk);
  for (int i = static_cast<int>(blockIdx.y) * kEmbedChunk + static_cast<int>(threadIdx.x); i < end;
       i += static_cast<int>(blockDim.x)) {
    float v[N] = {};
    if (!zero) load_f32<TIn, N>(src + static_cast<size_t>(i) * N, v);
    store_f32<TOut, N>(dst + static_cast<size_t>(i) * N, v);
  }
}

template <typename TIn, typename TOut, int N>
void launch_embedding(const EmbeddingParams& p, cudaStream_t stream) {
  const int accesses = p.hidden / N;
  const int threads = std::min(256, std::max(32, ceil_div(std::min(accesses, kEmbedChunk), 32) * 32));
  const dim3 grid(static_cast<unsigned>(p.tokens), static_cast<unsigned>(std::max(1, ceil_div(accesses, kEmbedChunk))));
  launch(embedding_kernel<TIn, TOut, N>, grid, dim3(static_cast<unsigned>(threads)), 0, stream, p);
  CHIMERA_LAUNCH_CHECK("ops::embedding");
}

// One launch for the gather (ids) and the identity copy with conversion (ids null).
void launch_gather(const EmbeddingParams& p, DType in_dtype, DType out_dtype, cudaStream_t stream) {
  constexpr int kN = 8;  // 16 bytes of bf16, two 16-byte accesses of f32
  const bool vec = vec_aligned({p.out, p.table}) && p.hidden % kN == 0;
  CHIMERA_DISPATCH_FLOAT(in_dtype, "ops::embedding table", TIn, {
    CHIMERA_DISPATCH_FLOAT(out_dtype, "ops::embedding out", TOut, {
      if (vec) {
        launch_embedding<TIn, TOut, kN>(p, stream);
      } else {
        launch_embedding<TIn, TOut, 1>(p, stream);
      }
    });
  });
}

}  // namespace

void embedding(const ops::Context& ctx, const Tensor& out, const Tensor& table, const ops::Indices& ids, int64_t first,
               bool shard) {
  const char* op = "ops::embedding";
  if (ids.empty() || out.dim(1) == 0) return;
  const cudaStream_t stream = as_stream(ctx.stream);
  EmbeddingParams p{out.data(), table.data(), nullptr, static_cast<int64_t>(ids.size()),
                    checked_int(op, "hidden size", table.dim(1))};
  if (shard) {
    p.first = first;
    p.rows = table.dim(0);
  }
  checked_int(op, "token count", p.tokens);
  p.ids = ids.device ? ids.device
                     : static_cast<const int32_t*>(
                           upload_scratch(ids.host.data(), ids.host.size_bytes(), stream, kIdsScratchSlot));
  launch_gather(p, table.dtype(), out.dtype(), stream);
}

void convert(const ops::Context& ctx, const Tensor& out, const Tensor& in) {
  const char* op = "ops::convert";
  if (in.dim(0) == 0 || in.dim(1) == 0) return;
  EmbeddingParams p{out.data(), in.data(), nullptr, in.dim(0), checked_int(op, "row length", in.dim(1))};
  checked_int(op, "row count", p.tokens);
  launch_gather(p, in.dtype(), out.dtype(), as_stream(ctx.stream));
}

// ---- RMSNorm family ----------------------------------------------------------------------------------

void rms_norm(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, float eps) {
  const char* op = "ops::rms_norm";
  require_same_dtype(op, {{"x", &x}, {"out", &out}});
  const norm::RowNormParams p{
      out.data(), x.data(), nullptr, nullptr, weight.data(), x.dim(0), checked_int(op, "hidden size", x.dim(1)),
      1,          eps};
  norm::launch_rms_norm(p, x.dtype(), weight.dtype(), as_stream(ctx.stream));
}

void add_rms_norm(const ops::Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& x,
                  const Tensor& weight, float eps) {
  const char* op = "ops::add_rms_norm";
  require_same_dtype(op, {{"x", &x}, {"residual", &residual}, {"out", &out}});
  const norm::RowNormParams p{
      out.data(), x.data(), nullptr, residual.data(), weight.data(), x.dim(0), checked_int(op, "hidden size", x.dim(1)),
      1,          eps};
  norm::launch_add_rms_norm(p, x.dtype(), weight.dtype(), as_stream(ctx.stream));
}

void add2_rms_norm(const ops::Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& a, const Tensor& b,
                   const Tensor& weight, float eps) {
  const char* op = "ops::add2_rms_norm";
  require_same_dtype(op, {{"a", &a}, {"b", &b}, {"residual", &residual}, {"out", &out}});
  // x = a, z = b: the kernel adds round(a + b) to the residual.
  const norm::RowNormParams p{
      out.data(), a.data(), b.data(), residual.data(), weight.data(), a.dim(0), checked_int(op, "hidden size", a.dim(1)),
      1,          eps};
  norm::launch_add2_rms_norm(p, a.dtype(), weight.dtype(), as_stream(ctx.stream));
}

void gated_rms_norm(const ops::Context& ctx, const Tensor& out, const Tensor& y, const Tensor& z, const Tensor& weight,
                    int64_t n_groups, float eps) {
  const char* op = "ops::gated_rms_norm";
  require_same_dtype(op, {{"y", &y}, {"z", &z}, {"out", &out}});
  // Each (token, group) pair is one row of D / n_groups contiguous channels; group g uses weight row g.
  const int64_t group_size = y.dim(1) / n_groups;
  const norm::RowNormParams p{out.data(),
                              y.data(),
                              z.data(),
                              nullptr,
                              weight.data(),
                              y.dim(0) * n_groups,
                              checked_int(op, "group size", group_size),
                              checked_int(op, "n_groups", n_groups),
                              eps};
  norm::launch_gated_rms_norm(p, y.dtype(), weight.dtype(), as_stream(ctx.stream));
}

}  // namespace chimera::cuda
