#include "runtime/scheduler.h"

#include <algorithm>
#include <unordered_map>

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
  s.num_published = 0;
}

bool Scheduler::caches(const Sequence& s) const {
  return cache_.sizes().prefix_caching && s.sampling.prompt_logprobs < 0;
}

void Scheduler::hash_blocks(Sequence& s, int32_t num_tokens) const {
  const int32_t bs = cache_.sizes().block_size;
  for (auto i = static_cast<int32_t>(s.block_hashes.size()); (i + 1) * bs <= num_tokens; ++i) {
    const uint64_t parent = i == 0 ? kRootHash : s.block_hashes[static_cast<size_t>(i - 1)];
    s.block_hashes.push_back(block_hash(
        parent, std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(i * bs), static_cast<size_t>(bs))));
  }
}

int32_t Scheduler::prompt_checkpoint(const Sequence& s) const {
  const int32_t bs = cache_.sizes().block_size;
  return (s.prompt_len - 1) / bs * bs;
}

bool Scheduler::is_checkpoint_boundary(const Sequence& s, int32_t m) const {
  return m > 0 && (m % cache_.sizes().checkpoint_interval == 0 || m == prompt_checkpoint(s) || m == s.shared_kv_end);
}

int32_t Scheduler::match_prefix(Sequence& s, std::vector<int32_t>& blocks, int32_t& checkpoint) {
  checkpoint = -1;
  if (!caches(s)) return 0;
  const int32_t bs = cache_.sizes().block_size;
  const auto len = static_cast<int32_t>(s.tokens.size());
  hash_blocks(s, len);
  const std::vector<int32_t> matched = cache_.block_pool().match(s.block_hashes, s.tokens);
  // The last token is always computed: its logits sample the next one.
  const int32_t limit = std::min(static_cast<int32_t>(matched.size()) * bs, len - 1);
  int32_t p = 0;
  if (!cache_.has_mamba()) {
    p = limit / bs * bs;
  } else {
    // Checkpoints lie on block boundaries (every checkpoint_interval, and each prompt's last one): the longest wins.
    for (int32_t q = limit / bs * bs; q > 0; q -= bs) {
      const std::optional<int32_t> slot = cache_.checkpoints().find(s.block_hashes[static_cast<size_t>(q / bs - 1)]);
      if (slot) {
        p = q;
        checkpoint = *slot;
        break;
      }
    }
  }
  // Blocks someone computed before, past the last checkpoint: this prompt parts from that one there, which makes it
  // the place where the next prompt sharing the prefix wants to resume.
  s.shared_kv_end = limit / bs * bs > p ? limit / bs * bs : 0;
  blocks.assign(matched.begin(), matched.begin() + p / bs);
  cache_.block_pool().acquire(blocks);
  return p;
}

void Scheduler::plan_checkpoints(SchedulerOutput& out) {
  if (!cache_.sizes().prefix_caching || !cache_.has_mamba() || cache_.checkpoints().capacity() == 0) return;
  const int32_t bs = cache_.sizes().block_size;
  std::unordered_map<int32_t, int32_t> scheduled;  // sequence id -> its new tokens this step
  for (const ScheduledSeq& p : out.seqs) scheduled.emplace(p.seq_id, p.num_tokens);
  for (Sequence& s : running_) {
    const auto it = scheduled.find(s.id);
    if (it == scheduled.end() || !caches(s) || !s.drafts.empty() || it->second < 2) continue;  // no chunk this step
    const int32_t c = s.num_computed, end = c + it->second;
    // Every kind of checkpoint boundary lies on a block boundary.
    for (int32_t m = (c / bs + 1) * bs; m < end; m += bs) {
      if (!is_checkpoint_boundary(s, m)) continue;
      hash_blocks(s, m);
      if (const std::optional<int32_t> slot =
              cache_.checkpoints().insert(s.block_hashes[static_cast<size_t>(m / bs - 1)])) {
        out.checkpoints.push_back({s.id, m - c, *slot});
        ++prefix_stats_.checkpoints_saved;
      }
    }
  }
}

std::optional<SlotCopy> Scheduler::commit(Sequence& s) {
  if (!caches(s) || s.slot < 0 || s.finish == FinishReason::kError) return std::nullopt;
  const int32_t bs = cache_.sizes().block_size;
  const int32_t full = std::min(s.num_computed / bs, static_cast<int32_t>(s.blocks.size()));
  hash_blocks(s, full * bs);
  for (int32_t i = s.num_published; i < full; ++i) {
    cache_.block_pool().publish(
        s.blocks[static_cast<size_t>(i)], s.block_hashes[static_cast<size_t>(i)],
        std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(i * bs), static_cast<size_t>(bs)));
  }
  s.num_published = std::max(s.num_published, full);
  // A finished sequence's state may run past its tokens (a verify step that stopped inside its accepted run).
  if (s.finished() || !cache_.has_mamba() || !is_checkpoint_boundary(s, s.num_computed)) return std::nullopt;
  const std::optional<int32_t> slot =
      cache_.checkpoints().insert(s.block_hashes[static_cast<size_t>(s.num_computed / bs - 1)]);
  if (!slot) return std::nullopt;
  ++prefix_stats_.checkpoints_saved;
  return SlotCopy{*slot, s.slot};
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
    // A cached prefix first (its blocks referenced before the reservation, so that it cannot evict them).
    std::vector<int32_t> blocks;
    int32_t checkpoint = -1;
    const int32_t cached = match_prefix(s, blocks, checkpoint);
    const int32_t computed_before = s.num_computed;
    s.num_computed = cached;
    const int32_t n = std::min(budget, s.num_pending());
    const int32_t slot =
        cache_.reserve_blocks(blocks, tokens_to_reserve(s, n)) ? cache_.allocate_slot(checkpoint < 0) : -1;
    std::vector<int32_t> spare;
    if (slot >= 0) spare = cache_.allocate_spare_slots();
    if (slot < 0 || spare.size() != static_cast<size_t>(cache_.sizes().spare_slots)) {  // every sequence holds as many
      if (slot >= 0) cache_.release_slot(slot);
      cache_.release_blocks(blocks);
      s.num_computed = computed_before;
      break;
    }
    if (caches(s)) {
      prefix_stats_.queries += static_cast<int64_t>(s.tokens.size());
      prefix_stats_.hits += cached;
    }
    if (checkpoint >= 0) {
      out.restores.push_back({slot, checkpoint});
      ++prefix_stats_.restores;
    }
    s.num_published = cached / cache_.sizes().block_size;
    s.slot = slot;
    s.spare_slots = std::move(spare);
    s.blocks = std::move(blocks);
    out.seqs.push_back({s.id, n});
    budget -= n;
    running_.push_back(std::move(s));
    waiting_.pop_front();
  }
  plan_checkpoints(out);
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
