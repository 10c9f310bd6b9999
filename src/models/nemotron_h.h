// Nemotron-H / Nemotron 3 (model_type "nemotron_h"): the forward step over the weights of models/nemotron_h_weights.h.
// Reads like transformers' modeling_nemotron_h.py: embeddings -> [norm -> mixer -> residual add] per layer
// -> norm_f -> lm_head, with the mixer chosen by the layer pattern (M Mamba-2, * attention, - MLP, E MoE).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h_weights.h"
#include "ops/ops.h"
#include "runtime/batch.h"
#include "runtime/model.h"
#include "runtime/state_cache.h"

namespace chimera {

class NemotronH : public Model {
 public:
  // Binds every tensor of the checkpoint by name (models/nemotron_h_weights.h: load_weights), checking it against the
  // config's shape and the checkpoint's quantization config (hf_quant_config.json / quantization_config: FP8 and
  // NVFP4 modules as ModelOpt exports them). Accepts NVIDIA's published naming (backbone.*, backbone.embeddings or
  // backbone.embedding, one tensor per expert) and transformers' in-memory naming (model.*, fused experts).
  // Missing, unexpected, mis-shaped and mis-typed tensors are kInvalidInput errors naming the tensor (and the file).
  // The MTP head (mtp.*) is loaded when the config has one (num_nextn_predict_layers > 0) and the checkpoint carries
  // its tensors; a config without a head ignores them.
  // With options.device kCuda the weights are uploaded (a progress line on stderr when it is a terminal).
  static NemotronH load(const ModelConfig& config, const Checkpoint& checkpoint, const ModelOptions& options = {});
  // A random-weight model of `config` (a preset, io/model_presets.h), built in memory through the same name
  // table and shapes as load(): each tensor is generated on its own, deterministically from (seed, name), in
  // options.dtype (fp32 for A_log, D, dt_bias and the router's correction bias) with scales that keep the
  // activations O(1). On CUDA each layer is uploaded as soon as it is made. An MTP head when the config has one.
  static NemotronH synthetic(const ModelConfig& config, const ModelOptions& options = {}, uint64_t seed = 0);

  // The whole model's config (with tensor parallelism too: the logits rows are whole).
  const ModelConfig& config() const override { return config_; }
  // The rank's view of it (models/tensor_parallel.h rank_config): its heads, groups, intermediate columns and
  // vocabulary rows; config() without tensor parallelism. The rank's StateCache is made from this one.
  const ModelConfig& local_config() const { return local_; }
  const TensorParallel& tensor_parallel() const { return tp_; }
  // The communicator of the ranks (ModelOptions::tp; every rank's model gets the same group, size tp.size). Each
  // rank's forward runs on its own thread, all ranks in lockstep on the same StepBatch: every forward (and MTP
  // forward) step is a sequence of collectives. Needed before the first forward when tp.size > 1. `device`: the
  // device collectives of CUDA ranks on distinct GPUs (ops::TpGroup); null: CUDA collectives through `group`.
  void set_tensor_parallel_group(dist::HostCollectives* group, dist::DeviceGroup* device = nullptr);
  Device device() const override { return device_; }
  // The dtype of every activation, the conv state and the KV cache: F32 on the CPU, options.dtype on CUDA.
  DType activation_dtype() const override { return act_dtype_; }
  // The MTP head's blocks (num_nextn_predict_layers when the weights have a head, else 0).
  int mtp_blocks() const override { return static_cast<int>(w_.mtp.size()); }
  const ModelWeights& weights() const { return w_; }
  // Parameter count per layer kind name ("embeddings", "mamba", ..., "lm_head"); a quantized weight counts N x K.
  std::map<std::string, int64_t> parameter_counts() const;

  // One forward step on ctx.device (which must be the model's device): returns host fp32 logits
  // [batch.logit_rows.size(), vocab_size], whatever the device and activation dtype.
  Tensor forward(const ops::Context& ctx, const StepBatch& batch, ModelState& state) const override;
  // The same step leaving the logits where they were computed: [logit_rows, vocab_size] on ctx.device in the
  // activation dtype. Enqueues work on ctx.stream and does not wait for it (no host synchronisation on CUDA), so a
  // decode step can be captured in a CUDA graph when batch.device_meta is set.
  Tensor forward_device(const ops::Context& ctx, const StepBatch& batch, ModelState& state) const override;
  // The same step also leaving, for the MTP head, the backbone's output of every row in `hidden`: norm_f(h)
  // [num_tokens, hidden_size] on ctx.device in the activation dtype.
  Tensor forward_device(const ops::Context& ctx, const StepBatch& batch, ModelState& state,
                        Tensor& hidden) const override;

  // One step of MTP block `block` (docs/model.md 7): row r of `batch` carries the token that follows row r of the
  // backbone step (token_ids: e_{t+1}) and `hidden` row r is the backbone's output there (h_t, from the
  // forward_device above; for a deeper draft, the previous block step's mtp_hidden). The same cu_seqlens,
  // context_lens and block tables as the backbone step: the head's attention sublayers keep their own KV cache
  // at state index config.layers.size() + f (f: the sublayer in mtp.layers.f; CacheSizes::mtp). Returns the logits
  // of batch.logit_rows, which predict the token two after each row, [logit_rows, vocab_size] on ctx.device in the
  // activation dtype; mtp_hidden, when set, gets final_layernorm's output of every row [num_tokens, hidden_size].
  // Enqueued on ctx.stream like forward_device.
  Tensor mtp_forward_device(const ops::Context& ctx, const StepBatch& batch, const Tensor& hidden, ModelState& state,
                            int block, Tensor* mtp_hidden = nullptr) const override;

  // Debugging (chimera generate --dump-activations DIR; scripts/bf16_layer_error.py reads it): every later forward
  // step that has prefill rows (an eager step, never a captured decode graph) writes, per layer i,
  //   DIR/step<s>_layer<i>_input.npy    [T, hidden] fp32: the residual stream entering layer i
  //   DIR/step<s>_layer<i>_experts.npy  [T, k] int32: a MoE layer's chosen experts, in the router's order
  // with s counting those steps from 0. Each write waits for the device (slow: for diagnosis only). Empty: off.
  void set_activation_dump(std::filesystem::path dir);

 private:
  // The step's rows as the attention layers see them (runtime/batch.h attention_rows): the host lists, the same on
  // the device when the step's metadata is there, and one block-table row per attention row on ctx.device.
  // shared_kv: some rows are positions of one sequence (a verify step), so the op must append every row's k / v
  // before any row attends.
  struct AttentionView {
    AttentionRows rows;  // verify steps; otherwise the batch's own lists
    const std::vector<int32_t>* host_cu = nullptr;
    const std::vector<int32_t>* host_context = nullptr;
    const int32_t* device_cu = nullptr;
    const int32_t* device_context = nullptr;
    Tensor block_tables;
    bool shared_kv = false;
    ops::Indices cu_seqlens() const { return {shared_kv ? rows.cu_seqlens : *host_cu, device_cu}; }
    ops::Indices context_lens() const { return {shared_kv ? rows.context_lens : *host_context, device_context}; }
  };
  static AttentionView attention_view(const ops::Context& ctx, const StepBatch& batch);
  // The residual stream of one decoder stack: h and h_next its two buffers (a residual step folded into the next
  // layer's first dense op writes the other one), x the current mixer's normed input, mix and routed the mixer's
  // outputs (routed: a MoE layer's routed experts, added in the norm kernel); spec the step's verify plan (Mamba),
  // attn its attention rows.
  struct Stream {
    Tensor h, h_next, x, mix, routed;
    SpecPlan spec;
    AttentionView attn;
  };

  NemotronH() = default;
  static NemotronH with_options(const ModelConfig& config, const ModelOptions& options);
  // An uninitialised activation on `device` in the activation dtype.
  Tensor act(const ops::Context& ctx, Shape shape) const;
  // set_activation_dump's write of `t` as DIR/step<s>_layer<layer>_<what>.npy, when this step is dumped.
  void dump_activation(size_t layer, const char* what, const Tensor& t) const;
  // The Mamba and attention mixers read their normed input x only through their first dense op; `pre`, when set,
  // is the residual step that produces x (pre->x == x), folded into that op (ops::residual_norm_linear).
  void mamba_mixer(const ops::Context& ctx, const LayerWeights& w, const StepBatch& batch, const SpecPlan& spec,
                   const Tensor& conv_state, const Tensor& ssm_state, const ops::ResidualNorm* pre, const Tensor& x,
                   const Tensor& out) const;
  // The Mamba layer's speculative verify rows (StepBatch::num_spec_seqs): from their in_proj rows (zxbcdt, every row of
  // the step) to their rows of normed, one out-of-place single-token update per draft position.
  void spec_mamba(const ops::Context& ctx, const MambaWeights& w, const StepBatch& batch, const SpecPlan& spec,
                  const Tensor& zxbcdt, const ops::SsmParams& sp, const Tensor& conv_state, const Tensor& ssm_state,
                  const Tensor& normed) const;
  // view: the step's attention rows (built once per step: the block tables go up once on CUDA).
  void attention_mixer(const ops::Context& ctx, const LayerWeights& w, const AttentionView& view,
                       const ops::KvCacheView& kv, const ops::ResidualNorm* pre, const Tensor& x,
                       const Tensor& out) const;
  // Runs `layers` over s.h (x holding layers[0]'s norm of h on entry); layer j's caches and dumps are at index
  // first + j. Ends with x = final_norm(h), or with that residual step left in `pending` when fold_final (returns
  // true: the caller folds it into its lm_head).
  bool run_layers(const ops::Context& ctx, const StepBatch& batch, ModelState& state,
                  std::span<const LayerWeights> layers, size_t first, Stream& s, const Tensor& final_norm,
                  bool fold_final, ops::ResidualNorm& pending) const;
  // forward_device with the backbone's output in *hidden when hidden is set.
  Tensor forward_impl(const ops::Context& ctx, const StepBatch& batch, ModelState& state, Tensor* hidden) const;
  // Stream buffers for T rows of `layers`.
  Stream stream(const ops::Context& ctx, int64_t T, std::span<const LayerWeights> layers) const;
  // Logits of batch.logit_rows from x (a final norm's output of every row).
  Tensor head_logits(const ops::Context& ctx, const StepBatch& batch, const Tensor& x) const;
  // out [T, hidden] = the embeddings of `ids`; vocabulary-parallel: each rank looks up the ids of its rows (zero
  // rows for the others') and one all_reduce completes every row.
  void embed(const ops::Context& ctx, const Tensor& out, const ops::Indices& ids) const;
  // Tensor parallelism: `local` [R, vocab_size / size] (the rank's lm_head rows) gathered into whole rows; the
  // tensor itself without it.
  Tensor whole_logits(const ops::Context& ctx, const Tensor& local) const;
  // The MoE mixer's two outputs, left unsummed: the forward adds both to the residual in add2_rms_norm. `layer`
  // names its dumps. Returns whether they are this rank's parts still to be summed (always without tensor
  // parallelism); false: a LatentMoE layer under tensor parallelism summed both itself.
  bool moe_mixer(const ops::Context& ctx, size_t layer, const LayerWeights& w, const Tensor& x,
                 const Tensor& shared_out, const Tensor& routed_out) const;

  ModelConfig config_;
  ModelConfig local_;  // rank_config(config_, tp_): the sizes every activation and weight of the forward has
  TensorParallel tp_;
  ops::TpGroup group_;  // the communicator (set_tensor_parallel_group); null without tensor parallelism
  // The Mamba gated norm's group when it spans ranks (config n_groups < tp size): spanned_norm() points to it.
  ops::SpannedNorm spanned_;
  bool norm_spans_ = false;
  const ops::SpannedNorm* spanned_norm() const { return norm_spans_ ? &spanned_ : nullptr; }
  Device device_ = Device::kCpu;
  DType act_dtype_ = DType::kF32;
  ModelWeights w_;
  std::filesystem::path dump_dir_;     // set_activation_dump; empty: off
  // The dumped step's number, -1 while the current step is not dumped; both written only while a dump is on.
  mutable int dump_step_ = -1;
  mutable int dumped_steps_ = 0;
};

}  // namespace chimera
