// The weights of a Nemotron-H model (docs/quantization.md 5): one struct per mixer, every linear layer an
// ops::LinearWeight and every MoE projection's routed experts an ops::ExpertWeights, in the format the checkpoint
// stores them (dense, FP8, NVFP4). One name table (weight_slots) lists every tensor with its checkpoint name, its
// shape, its role and where it lives; the loader, the synthetic source, the uploader, the parameter count and the
// byte count all walk it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "io/model_config.h"
#include "io/quant_config.h"
#include "io/safetensors.h"
#include "models/tensor_parallel.h"
#include "ops/ops.h"
#include "ops/quant_weights.h"

namespace chimera {

// Member names equal the checkpoint keys under `backbone.layers.{i}.mixer.` (docs/style.md 1: loading is a name
// table). Linear shapes are [out, in] as the layer computes them (the stored tensor of a quantized one differs:
// ops/quant_weights.h).
struct MambaWeights {
  ops::LinearWeight in_proj;  // [2*Di + 2*G*N + H, D]
  Tensor in_proj_bias;        // [2*Di + 2*G*N + H] when use_bias
  Tensor conv1d_weight;       // [Cd, K] (checkpoint [Cd, 1, K])
  Tensor conv1d_bias;         // [Cd] when use_conv_bias
  ops::SsmParams ssm;         // A_log, D, dt_bias as F32 [H]; time_step_limit
  Tensor norm;                // [Di] gated grouped RMSNorm weight
  ops::LinearWeight out_proj;  // [D, Di]
  Tensor out_proj_bias;        // [D] when use_bias
};

struct AttentionWeights {
  ops::LinearWeight q_proj;  // [Qh*hd, D]
  ops::LinearWeight k_proj;  // [KVh*hd, D]
  ops::LinearWeight v_proj;  // [KVh*hd, D]
  ops::LinearWeight o_proj;  // [D, Qh*hd]
  // The FP8 KV cache's scales (k_proj.k_scale / v_proj.v_scale in ModelOpt checkpoints with kv_cache_quant_algo);
  // 0 when the checkpoint has none.
  float k_scale = 0.0f;
  float v_scale = 0.0f;
};

struct MlpWeights {
  ops::LinearWeight up_proj;    // [I, D]
  ops::LinearWeight down_proj;  // [D, I]
};

struct MoeWeights {
  Tensor gate;                     // [E, D] router (never quantized)
  Tensor e_score_correction_bias;  // [E] F32
  ops::ExpertWeights experts_up;   // [E, I_moe, Lat|D]
  ops::ExpertWeights experts_down;  // [E, Lat|D, I_moe]
  // Dense experts: per-expert views of experts_up / experts_down's buffers, for the dense ops (moe_experts_shared);
  // empty when the experts are quantized.
  std::vector<Tensor> up_views, down_views;
  MlpWeights shared_experts;          // [I_sh, D], [D, I_sh]
  ops::LinearWeight fc1_latent_proj;  // [Lat, D] when moe_latent_size
  ops::LinearWeight fc2_latent_proj;  // [D, Lat]
};

struct LayerWeights {
  LayerKind kind;
  Tensor norm;  // [D] pre-mixer RMSNorm
  MambaWeights mamba;
  AttentionWeights attention;
  MlpWeights mlp;
  MoeWeights moe;
};

// Where the model runs, in which dtype, and how its weights are stored.
//   CPU: dense weights stay zero-copy views of the checkpoint mmap (any float dtype), activations are F32; `dtype`
//        is not used (the CPU backend is the fp32 reference).
//   CUDA: every dense weight is uploaded once at load, converted to `dtype` (the activation dtype: bf16 for the
//        product, fp32 for exact comparisons with the CPU and transformers); the small SSM parameters (A_log,
//        D, dt_bias), the router's correction bias and the router gate stay F32 (the router runs in fp32 as in
//        transformers); each MoE layer's experts live in one device buffer [E, N, K]. Quantized weights keep their
//        stored bytes on every device.
struct ModelOptions {
  Device device = Device::kCpu;
  DType dtype = DType::kBF16;
  // Quantize a dense checkpoint's (or a synthetic model's) linear layers at load (--quantization fp8 | nvfp4), as
  // ModelOpt's per-tensor FP8 and NVFP4 weight quantizers do (core/fp8.h, core/nvfp4.h), with ModelOpt's default
  // exclusions: lm_head, the router, conv1d and the embeddings stay dense. There is no calibration: FP8
  // layers and experts quantize their activations dynamically (ActQuant::kDynamic), NVFP4 ones run weight-only
  // (ActQuant::kNone). kDense: off. A checkpoint that is already quantized -> kInvalidInput.
  ops::WeightFormat quantize = ops::WeightFormat::kDense;
  // Run every FP8 layer weight-only (ActQuant::kNone), ignoring the checkpoint's static input scales: ModelOpt's
  // weights-only reference (its input quantizers disabled).
  bool weight_only = false;
  // Tensor parallelism (docs/architecture.md "Tensor parallelism"): this model holds rank tp.rank's shard of every
  // weight (the name table's shard column) and its forward sums the row-parallel outputs through the communicator
  // given to NemotronH::set_tensor_parallel_group.
  TensorParallel tp;
};

// One block of the multi-token-prediction head (Nemotron 3 Super's mtp.*; docs/model.md 7): the sublayers of
// mtp_hybrid_override_pattern, flattened in the checkpoint as mtp.layers.{block * len(pattern) + j}. The block-level
// tensors sit on its first sublayer (enorm, hnorm, eh_proj) and its last (final_layernorm).
struct MtpBlockWeights {
  Tensor enorm;                      // [D] RMSNorm of the next token's embedding
  Tensor hnorm;                      // [D] RMSNorm of the backbone's hidden state
  ops::LinearWeight eh_proj;         // [D, 2D] over concat[enorm(e), hnorm(h)], the embedding first
  std::vector<LayerWeights> layers;  // one per pattern character (attention, MLP or MoE: no Mamba)
  Tensor final_layernorm;            // [D]
};

struct ModelWeights {
  Tensor embeddings;  // [V, D]
  std::vector<LayerWeights> layers;
  Tensor norm_f;                // [D]
  ops::LinearWeight lm_head;    // [V, D]
  // num_nextn_predict_layers blocks when the checkpoint has mtp.* tensors (or a synthetic model's config asks for
  // them); empty otherwise. Embeddings and lm_head are the backbone's.
  std::vector<MtpBlockWeights> mtp;
};

// One entry of the name table.
struct WeightSlot {
  enum class Role : uint8_t {
    kTensor,      // a dense tensor, in the activation dtype on CUDA (norms, conv1d, biases, embeddings)
    kRouterGate,  // the router gate: as stored on the CPU, fp32 holding model-dtype values on CUDA
    kSsmParam,    // A_log, D, dt_bias: fp32 on the CPU, fp32 holding model-dtype values on CUDA
    kF32,         // fp32 everywhere (e_score_correction_bias)
    kLinear,      // an ops::LinearWeight
    kExperts,     // an ops::ExpertWeights
  };
  std::string name;  // canonical checkpoint name (no "backbone." prefix): a tensor's full name, a linear module's
                     // prefix ("layers.0.mixer.in_proj"), the experts' "layers.3.mixer.experts.{e}.up_proj"
  std::string kind;  // what chimera info groups it under: a layer kind name, "embeddings", "norm_f", "lm_head"
  int layer = -1;    // its layer, -1 for the embeddings, norm_f and lm_head; the MTP head's sublayer f (mtp.layers.f)
                     // is layers.size() + f (mtp_layer_count: how many there are)
  Role role = Role::kTensor;
  Shape shape;  // tensors: the checkpoint shape; linear: [N, K]; experts: [E, N, K] (the full tensor's)
  // Where the model's rank holds its part of the full tensor (models/tensor_parallel.h); replicated without tensor
  // parallelism. The model's tensor has shard.local_shape(shape) (linear: [N, K]; experts: [E, N, K]).
  Shard shard;
  Tensor* tensor = nullptr;
  ops::LinearWeight* linear = nullptr;
  ops::ExpertWeights* experts = nullptr;
};

// The name table of a model of `config` whose weights are (or will be) `w`: w.layers must already hold one entry
// per layer with its kind, and w.mtp its blocks' sublayers (the slots point into them). Entries come layer by
// layer, the embeddings, norm_f and lm_head first, the MTP head's sublayers (kind "mtp") last. With tensor
// parallelism (tp.size > 1) each slot's shard says which part of the full tensor rank tp.rank holds:
//   column-parallel by heads: q_proj; k_proj / v_proj (their KV heads replicated when ranks outnumber them);
//   Mamba in_proj (the rank's z, x and dt rows with the B and C rows of its groups, replicated when ranks
//   outnumber the groups), in_proj.bias, conv1d channels (x of its heads, B / C of its groups), A_log, D,
//   dt_bias, the gated norm's weight (its slice of d_inner);
//   column-parallel by intermediate: MLP up_proj, the shared expert's up_proj, the routed experts' up_proj [E, N];
//   row-parallel (the input dimension): o_proj, out_proj, MLP down_proj, the shared expert's down_proj, the routed
//   experts' down_proj [E, :, K]; a row-parallel bias on rank 0 only;
//   vocabulary-parallel: embeddings and lm_head rows;
//   replicated: every RMSNorm weight but the gated one, the router gate and correction bias, the latent MoE
//   projections, the MTP head's enorm / hnorm / eh_proj / final_layernorm.
std::vector<WeightSlot> weight_slots(const ModelConfig& config, ModelWeights& w, const TensorParallel& tp = {});
// The MTP head's sublayers in `w` (num_nextn_predict_layers x the pattern's length when it has a head, else 0).
int mtp_layer_count(const ModelWeights& w);
// What share of a checkpoint tensor rank tp holds (the name table's shard column, for a file's tensors without
// loading them): name is the tensor's checkpoint name ("backbone." optional; a linear module's weight, block
// scales and bias follow the module, one expert's tensors their experts slot); 1 for a tensor the rank holds whole
// (replicated, scalar scales, or tp.size 1), 0 for one it does not hold (a rank-0-only bias on another rank); names
// outside the table (MTP, unknown) count whole.
std::function<double(const std::string& name, int64_t numel)> rank_shares(const ModelConfig& config,
                                                                          const TensorParallel& tp);

// Every weight from the checkpoint through the name table, in the format its quantization config (DIR/
// hf_quant_config.json or config.json's quantization_config, io/quant_config.h) says: a module the config does not
// quantize is dense. FP8: weight F8_E4M3 [N, K], weight_scale F32 scalar, input_scale F32 scalar (-> kStatic W8A8;
// without it weight-only); NVFP4: weight U8 [N, K / 2], weight_scale F8_E4M3 [N, K / 16], weight_scale_2 F32,
// input_scale (kept, unused: NVFP4 runs weight-only). Per-expert tensors become one [E, ...] buffer per projection
// (zero-copy when the checkpoint stores them back to back). Missing, unexpected, mis-shaped and mis-typed tensors,
// scales that are not positive finite scalars, an odd or non-multiple-of-16 NVFP4 K and tensors whose format
// disagrees with the config are kInvalidInput naming the tensor. Host tensors; upload_weights moves them.
ModelWeights load_weights(const ModelConfig& config, const Checkpoint& checkpoint,
                          const std::optional<QuantConfig>& quant, const ModelOptions& options);
// A random-weight model through the same name table (NemotronH::synthetic documents the values). With `on_layer`,
// called after each layer is complete (the CUDA path uploads it there, so the host holds one layer at a time).
ModelWeights synthetic_weights(const ModelConfig& config, const ModelOptions& options, uint64_t seed,
                               const std::function<void(ModelWeights&, int layer)>& on_layer = {});

// Moves every weight to the GPU (ModelOptions says in which dtype); layer < 0: the embeddings, norm_f and lm_head,
// else that layer. Prints a progress line on stderr when it is a terminal.
class WeightUploader {
 public:
  WeightUploader(const ModelConfig& config, DType dtype);
  ~WeightUploader();
  WeightUploader(const WeightUploader&) = delete;
  WeightUploader& operator=(const WeightUploader&) = delete;
  void upload(ModelWeights& w, int layer);

 private:
  const ModelConfig& config_;
  DType dtype_;
  bool show_;
  size_t bytes_ = 0;
};

// Fills each dense MoE layer's per-expert views (after loading or uploading).
void bind_expert_views(ModelWeights& w);

// Per layer kind name ("embeddings", "mamba", ..., "lm_head", "mtp"): parameters (a quantized weight counts its
// logical N x K elements, not its scales) and bytes as stored (scales included), and the formats of its linear
// layers ("dense", "fp8", "nvfp4"; several joined by "+").
struct KindWeights {
  int64_t parameters = 0;
  int64_t bytes = 0;
  std::string formats;
};
std::map<std::string, KindWeights> weight_summary(const ModelConfig& config, const ModelWeights& w);

// The weight bytes one batch-1 decode token reads, as stored: every weight once, but one embedding row and top-k of
// E of each MoE layer's routed experts (the batch-1 roofline of runtime/roofline.h in stored bytes; MTP excluded).
double decode_bytes_per_token(const ModelConfig& config, const ModelWeights& w);

}  // namespace chimera
