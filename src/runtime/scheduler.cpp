#include "runtime/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace chimera {

Scheduler::Scheduler(const SchedulerConfig& config, StateCache& cache) : config_(config), cache_(cache) {
  if (config_.max_num_seqs < 1) invalid_input("--max-num-seqs must be >= 1, got {}", config_.max_num_seqs);
  if (config_.max_num_batched_tokens < 1) {
    invalid_input("--max-num-batched-tokens must be >= 1, got {}", config_.max_num_batched_tokens);
  }
  if (config_.max_waiting < 0) invalid_input("the waiting-queue bound must be >= 0, got {}", config_.max_waiting);
}

void Scheduler::add(Sequence seq) {
  if (seq.tokens.empty()) invalid_input("request {}: the prompt is empty", seq.id);
  if (static_cast<int32_t>(seq.tokens.size()) > cache_.sizes().max_model_len) {
    invalid_input("request {}: prompt of {} tokens exceeds --max-model-len {}", seq.id, seq.tokens.size(),
                  cache_.sizes().max_model_len);
  }
  if (config_.max_waiting > 0 && static_cast<int32_t>(waiting_.size()) >= config_.max_waiting) {
    throw Error(ErrorKind::kOverloaded,
                fmt::format("request {}: the waiting queue is full ({} requests)", seq.id, waiting_.size()));
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

void Scheduler::release(Sequence& s) {
  cache_.release_slot(s.slot);
  for (int32_t slot : s.spare_slots) cache_.release_slot(slot);
  cache_.release_blocks(s.blocks);
  s.slot = -1;
  s.spare_slots.clear();
}

int32_t Scheduler::tokens_to_reserve(const Sequence& s, int32_t n) const {
  const int32_t extra = std::max(0, config_.num_speculative_tokens - 1);
  return std::min(s.num_computed + n + extra, std::max(cache_.sizes().max_model_len, s.num_computed + n));
}

void Scheduler::preempt_last(SchedulerOutput& out, int32_t& budget) {
  Sequence& v = running_.back();
  // Already given tokens this step (a decode scheduled before a prompt chunk that needs its blocks): take back.
  auto it = std::find_if(out.seqs.begin(), out.seqs.end(), [&](const ScheduledSeq& s) { return s.seq_id == v.id; });
  if (it != out.seqs.end()) {
    budget += it->num_tokens;
    out.seqs.erase(it);
  }
  release(v);
  v.num_computed = 0;
  v.drafts.clear();  // the draft head's cache is gone with the blocks: the recomputation drafts anew
  v.draft_probs.clear();
  ++v.num_preemptions;
  ++num_preemptions_;
  out.preempted.push_back(v.id);
  waiting_.push_front(std::move(v));
  running_.pop_back();
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int32_t budget = config_.max_num_batched_tokens;

  // 1. Running sequences: past their prompt first (decodes), then those in their prompt (chunked prefill).
  //    Each gets its pending tokens, as many as the budget allows, and the KV blocks they need, preempting
  //    from the most recently admitted end when the pool is short.
  for (const bool prompt_phase : {false, true}) {
    for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
      Sequence& s = running_[i];
      if (s.finished() || s.in_prefill() != prompt_phase) continue;
      // A decode with drafts verifies them in the same step (all or, when the budget is short, a prefix).
      const int32_t pending = s.num_pending() + (prompt_phase ? 0 : static_cast<int32_t>(s.drafts.size()));
      const int32_t n = std::min(budget, pending);
      if (n <= 0) continue;
      bool self_preempted = false;
      while (!cache_.reserve_blocks(s.blocks, tokens_to_reserve(s, n))) {
        // The pool holds at least one sequence of max_model_len (StateCache checks), so a sequence alone
        // always fits and there is someone to preempt.
        CHIMERA_CHECK(running_.size() > 1, "sequence {} alone does not fit the KV pool", s.id);
        self_preempted = running_.size() - 1 == i;
        preempt_last(out, budget);
        if (self_preempted) break;
      }
      if (self_preempted) break;  // s was the last running sequence: nothing after it
      out.seqs.push_back({s.id, n});
      budget -= n;
    }
  }
  // 2. Admit waiting sequences in arrival order (preempted ones are at the front) while slots, blocks and
  //    budget last. Admission never preempts.
  while (!waiting_.empty() && budget > 0 && static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    Sequence& s = waiting_.front();
    const int32_t n = std::min(budget, s.num_pending());
    std::vector<int32_t> blocks;
    if (!cache_.reserve_blocks(blocks, tokens_to_reserve(s, n))) break;
    const int32_t slot = cache_.allocate_slot();
    if (slot < 0) {
      cache_.release_blocks(blocks);
      break;
    }
    std::vector<int32_t> spare = cache_.allocate_spare_slots();
    if (spare.size() != static_cast<size_t>(cache_.sizes().spare_slots)) {  // every sequence holds as many
      cache_.release_slot(slot);
      cache_.release_blocks(blocks);
      break;
    }
    s.slot = slot;
    s.spare_slots = std::move(spare);
    s.blocks = std::move(blocks);
    out.seqs.push_back({s.id, n});
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
    release(*r);
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
      release(*it);
      done.push_back(std::move(*it));
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  return done;
}

}  // namespace chimera
