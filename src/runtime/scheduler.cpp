#include "runtime/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace chimera {

Scheduler::Scheduler(const SchedulerConfig& config, StateCache& cache) : config_(config), cache_(cache) {
  if (config_.max_num_seqs < 1) invalid_input("--max-num-seqs must be >= 1, got {}", config_.max_num_seqs);
  if (config_.max_num_batched_tokens < 1) {
    invalid_input("--max-num-batched-tokens must be >= 1, got {}", config_.max_num_batched_tokens);
  }
}

void Scheduler::add(Sequence seq) {
  if (seq.tokens.empty()) invalid_input("request {}: the prompt is empty", seq.id);
  if (static_cast<int32_t>(seq.tokens.size()) > cache_.sizes().max_model_len) {
    invalid_input("request {}: prompt of {} tokens exceeds --max-model-len {}", seq.id, seq.tokens.size(),
                  cache_.sizes().max_model_len);
  }
  waiting_.push_back(std::move(seq));
}

Sequence& Scheduler::get(int32_t id) {
  for (Sequence& s : running_) {
    if (s.id == id) return s;
  }
  for (Sequence& s : waiting_) {
    if (s.id == id) return s;
  }
  runtime_error("scheduler: no sequence {}", id);
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int32_t budget = config_.max_num_batched_tokens;

  // 1. Every running sequence past its prompt decodes one token (it needs room for that token's KV).
  for (Sequence& s : running_) {
    if (s.finished() || s.in_prefill() || budget == 0) continue;
    if (!cache_.reserve_blocks(s.blocks, s.num_computed + 1)) {
      runtime_error("KV cache exhausted while decoding sequence {} ({} free blocks)", s.id, cache_.free_blocks());
    }
    out.decode.push_back({s.id, 1});
    --budget;
  }
  // 2. Running sequences still in their prompt continue their prefill (chunked).
  for (Sequence& s : running_) {
    if (s.finished() || !s.in_prefill() || budget == 0) continue;
    const int32_t n = std::min(budget, s.prompt_len - s.num_computed);
    if (!cache_.reserve_blocks(s.blocks, s.num_computed + n)) continue;
    out.prefill.push_back({s.id, n});
    budget -= n;
  }
  // 3. Admit waiting sequences in arrival order while slots, blocks and budget last.
  while (!waiting_.empty() && budget > 0 && static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    Sequence& s = waiting_.front();
    const int32_t n = std::min(budget, s.prompt_len - s.num_computed);
    std::vector<int32_t> blocks;
    if (!cache_.reserve_blocks(blocks, s.num_computed + n)) break;
    const int32_t slot = cache_.allocate_slot();
    if (slot < 0) {
      cache_.release_blocks(blocks);
      break;
    }
    s.slot = slot;
    s.blocks = std::move(blocks);
    out.prefill.push_back({s.id, n});
    budget -= n;
    running_.push_back(std::move(s));
    waiting_.pop_front();
  }
  return out;
}

std::optional<Sequence> Scheduler::abort(int32_t id) {
  Sequence out;
  auto r = std::find_if(running_.begin(), running_.end(), [id](const Sequence& s) { return s.id == id; });
  if (r != running_.end()) {
    if (r->finished()) return std::nullopt;
    cache_.release_slot(r->slot);
    cache_.release_blocks(r->blocks);
    r->slot = -1;
    out = std::move(*r);
    running_.erase(r);
  } else {
    auto w = std::find_if(waiting_.begin(), waiting_.end(), [id](const Sequence& s) { return s.id == id; });
    if (w == waiting_.end() || w->finished()) return std::nullopt;
    out = std::move(*w);
    waiting_.erase(w);
  }
  out.finish = FinishReason::kAbort;
  return out;
}

std::vector<Sequence> Scheduler::collect_finished() {
  std::vector<Sequence> done;
  for (auto it = running_.begin(); it != running_.end();) {
    if (it->finished()) {
      cache_.release_slot(it->slot);
      cache_.release_blocks(it->blocks);
      it->slot = -1;
      done.push_back(std::move(*it));
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  return done;
}

}  // namespace chimera
