#include "server/engine_loop.h"

#include <cstdio>

#include <fmt/core.h>

#include "core/error.h"
#include "server/api.h"

namespace chimera::server {

namespace {
using Clock = std::chrono::steady_clock;
double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
const char* reason_label(FinishReason r, bool aborted) {
  if (aborted || r == FinishReason::kAbort) return "abort";
  if (r == FinishReason::kError) return "error";
  return r == FinishReason::kStop ? "stop" : "length";
}
}  // namespace

EngineLoop::EngineLoop(Engine& engine, Metrics& metrics, EngineLoopConfig config, int32_t max_num_seqs)
    : engine_(engine), metrics_(metrics), config_(config), max_num_seqs_(max_num_seqs) {
  update_gauges();  // every series exists from the start (the counters at zero), before the engine thread runs
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() { stop(); }

uint64_t EngineLoop::submit(std::vector<SeqRequest> seqs, std::shared_ptr<RequestSink> sink, Clock::time_point arrival) {
  std::lock_guard lock(mu_);
  if (stopping_) throw ApiError(503, "the server is shutting down");
  if (!failure_.empty()) throw ApiError(503, fmt::format("the engine can run no more steps: {}", failure_));
  const int64_t n = static_cast<int64_t>(seqs.size());
  if (in_flight_ + n > int64_t{max_num_seqs_} + config_.max_waiting_seqs) {
    throw ApiError(503, fmt::format("the server is at capacity ({} sequences running or waiting); retry later",
                                    in_flight_));
  }
  const uint64_t first = next_handle_;
  next_handle_ += static_cast<uint64_t>(n);
  in_flight_ += n;
  pending_.push_back(Pending{first, std::move(seqs), std::move(sink), arrival});
  cv_.notify_one();
  return first;
}

void EngineLoop::abort(uint64_t handle, bool as_stop) {
  std::lock_guard lock(mu_);
  pending_aborts_.emplace_back(handle, as_stop);
  cv_.notify_one();
}

std::string EngineLoop::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

int64_t EngineLoop::in_flight() const {
  std::lock_guard lock(mu_);
  return in_flight_;
}

void EngineLoop::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    cv_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::finish(int32_t seq_id, Live& live, FinishReason reason, bool aborted,
                        std::unordered_map<RequestSink*, std::pair<std::shared_ptr<RequestSink>, std::vector<SeqEvent>>>& out) {
  const Clock::time_point now = Clock::now();
  metrics_.record_finished(reason_label(reason, aborted), live.prompt_len, live.generated, seconds(now - live.arrival),
                           live.queue_time_recorded ? live.queue_seconds : seconds(now - live.arrival));
  if (aborted) {
    auto& slot = out[live.sink.get()];
    slot.first = live.sink;
    slot.second.push_back(SeqEvent{live.choice, -1, FinishReason::kStop, true});
  }
  handles_.erase(live.handle);
  live_.erase(seq_id);
  std::lock_guard lock(mu_);
  --in_flight_;
}

void EngineLoop::apply_pending(std::deque<Pending>& adds, std::vector<std::pair<uint64_t, bool>>& aborts) {
  std::unordered_map<RequestSink*, std::pair<std::shared_ptr<RequestSink>, std::vector<SeqEvent>>> out;
  for (Pending& p : adds) {
    for (size_t i = 0; i < p.seqs.size(); ++i) {
      const uint64_t handle = p.first_handle + i;
      const int32_t prompt_len = static_cast<int32_t>(p.seqs[i].prompt.size());
      int32_t sid = -1;
      try {
        sid = engine_.add_request(std::move(p.seqs[i].prompt), p.seqs[i].sampling);
      } catch (const Error& e) {
        // The HTTP side validated the request; a refusal here still reaches its client as an error.
        p.sink->on_error(e.kind() == ErrorKind::kInvalidInput ? 400 : e.kind() == ErrorKind::kOverloaded ? 503 : 500,
                         e.what());
        std::lock_guard lock(mu_);
        --in_flight_;
        continue;
      } catch (const std::exception& e) {
        p.sink->on_error(500, e.what());
        std::lock_guard lock(mu_);
        --in_flight_;
        continue;
      }
      live_.emplace(sid, Live{handle, static_cast<int32_t>(i), p.sink, p.arrival, p.arrival, prompt_len});
      handles_.emplace(handle, sid);
    }
  }
  for (const auto& [h, as_stop] : aborts) {
    auto it = handles_.find(h);
    if (it == handles_.end()) continue;  // finished already, or never admitted
    const int32_t sid = it->second;
    engine_.abort_request(sid);
    finish(sid, live_.at(sid), FinishReason::kStop, /*aborted=*/!as_stop, out);
  }
  for (auto& [ptr, ev] : out) ev.first->on_events(std::move(ev.second));
}

void EngineLoop::update_gauges() {
  metrics_.set_gauges(EngineGauges{engine_.num_running(), engine_.num_waiting(), engine_.kv_cache_usage()});
  metrics_.set_prefix_cache(engine_.prefix_cache_stats(), engine_.num_checkpoints(), engine_.checkpoint_capacity());
  const SpeculativeStats& sp = engine_.speculative_stats();
  if (!sp.accepted_per_position.empty()) {
    metrics_.set_speculative(sp.num_drafts, sp.num_draft_tokens, sp.num_accepted_tokens, sp.accepted_per_position);
  }
}

void EngineLoop::account_step(Clock::time_point step_start, Clock::time_point now, int64_t generated) {
  const Engine::StepStats& st = engine_.last_step();
  // The interval starts with its first step, so idle time before it does not dilute the averages.
  if (totals_.eager_steps + totals_.graph_steps == 0) stats_since_ = step_start;
  const double step_seconds = seconds(now - step_start);
  totals_.prompt_tokens += st.prefill_tokens;
  totals_.generated += generated;
  if (st.graph) {
    ++totals_.graph_steps;
    totals_.graph_seconds += step_seconds;
  } else {
    ++totals_.eager_steps;
    totals_.eager_seconds += step_seconds;
  }
  if (config_.log_stats_interval_s <= 0) return;
  const double span = seconds(now - stats_since_);
  if (span < config_.log_stats_interval_s) return;
  const StepTotals& t = totals_;
  auto ms = [](double secs, int64_t n) { return n > 0 ? 1e3 * secs / static_cast<double>(n) : 0.0; };
  const std::string line = fmt::format(
      "Avg prompt throughput: {:.1f} tokens/s, Avg generation throughput: {:.1f} tokens/s, Running: {} reqs, "
      "Waiting: {} reqs, KV cache usage: {:.1f}%, Steps: {} (eager {} x {:.1f} ms, graph {} x {:.1f} ms)",
      static_cast<double>(t.prompt_tokens) / span, static_cast<double>(t.generated) / span, engine_.num_running(),
      engine_.num_waiting(), 100.0 * engine_.kv_cache_usage(), t.eager_steps + t.graph_steps, t.eager_steps,
      ms(t.eager_seconds, t.eager_steps), t.graph_steps, ms(t.graph_seconds, t.graph_steps));
  if (config_.log) {
    config_.log(line);
  } else {
    fmt::print("chimera serve: {}\n", line);
    std::fflush(stdout);
  }
  totals_ = StepTotals{};
  stats_since_ = now;
}

void EngineLoop::run() {
  std::deque<Pending> adds;
  std::vector<std::pair<uint64_t, bool>> aborts;
  for (;;) {
    bool stopping = false;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !pending_.empty() || !pending_aborts_.empty() || !live_.empty() ||
                            engine_.has_unfinished();
      });
      adds.swap(pending_);
      aborts.swap(pending_aborts_);
      stopping = stopping_;
      if (stopping) {
        // Shut down: nothing new runs; everything in flight is aborted.
        for (const auto& [h, sid] : handles_) aborts.emplace_back(h, false);
      }
    }
    if (stopping) {
      for (Pending& p : adds) {
        std::vector<SeqEvent> ev;
        for (size_t i = 0; i < p.seqs.size(); ++i) ev.push_back(SeqEvent{int32_t(i), -1, FinishReason::kStop, true});
        p.sink->on_events(std::move(ev));
        std::lock_guard lock(mu_);
        in_flight_ -= static_cast<int64_t>(p.seqs.size());
      }
      adds.clear();
      apply_pending(adds, aborts);
      update_gauges();
      return;
    }
    apply_pending(adds, aborts);
    adds.clear();
    aborts.clear();
    if (!engine_.has_unfinished()) {
      update_gauges();
      continue;
    }

    const Clock::time_point step_start = Clock::now();
    std::vector<TokenEvent> events;
    try {
      events = engine_.step();
    } catch (const std::exception& e) {
      // A failed step is the server's fault: every request in it gets the error and the engine is emptied of
      // them so that the server goes on for new requests, unless the model can run no more steps at all.
      if (std::string why = engine_.model().failure(); !why.empty()) {
        std::lock_guard lock(mu_);
        if (failure_.empty()) {
          failure_ = std::move(why);
          if (config_.log) {
            config_.log("chimera serve: the engine can run no more steps: " + failure_);
          } else {
            fmt::print("chimera serve: the engine can run no more steps: {}\n", failure_);
            std::fflush(stdout);
          }
        }
      }
      for (auto& [sid, live] : live_) live.sink->on_error(500, fmt::format("engine step failed: {}", e.what()));
      std::vector<int32_t> ids;
      for (const auto& [sid, live] : live_) ids.push_back(sid);
      for (int32_t sid : ids) {
        engine_.abort_request(sid);
        Live& l = live_.at(sid);
        l.sink = nullptr;
        metrics_.record_finished("abort", l.prompt_len, l.generated, 0.0, 0.0);
        handles_.erase(l.handle);
        live_.erase(sid);
        std::lock_guard lock(mu_);
        --in_flight_;
      }
      update_gauges();
      continue;
    }
    const Clock::time_point now = Clock::now();
    std::unordered_map<RequestSink*, std::pair<std::shared_ptr<RequestSink>, std::vector<SeqEvent>>> out;
    int64_t new_tokens = 0;
    std::vector<std::pair<int32_t, FinishReason>> done;
    for (TokenEvent& ev : events) {
      auto it = live_.find(ev.seq_id);
      if (it == live_.end()) continue;
      Live& l = it->second;
      if (ev.token >= 0) {
        ++new_tokens;
        if (l.generated == 0) {
          metrics_.observe_ttft(seconds(now - l.arrival));
          metrics_.add_prompt_tokens(l.prompt_len);
          // Waiting ends when the step that computes the prompt's last chunk starts.
          l.queue_seconds = seconds(step_start - l.arrival);
          l.queue_time_recorded = true;
        } else {
          metrics_.observe_inter_token(seconds(now - l.last_token));
        }
        ++l.generated;
        l.last_token = now;
      }
      auto& slot = out[l.sink.get()];
      slot.first = l.sink;
      slot.second.push_back(SeqEvent{l.choice, ev.token, ev.finish, false, ev.logprob, std::move(ev.top_logprobs),
                                     ev.error, std::move(ev.prompt_logprobs)});
      if (ev.finish != FinishReason::kNone) done.emplace_back(ev.seq_id, ev.finish);
    }
    metrics_.add_generation_tokens(new_tokens);
    account_step(step_start, now, new_tokens);
    for (const auto& [sid, reason] : done) finish(sid, live_.at(sid), reason, /*aborted=*/false, out);
    engine_.take_finished();
    for (auto& [ptr, ev] : out) ev.first->on_events(std::move(ev.second));
    update_gauges();
  }
}

}  // namespace chimera::server
