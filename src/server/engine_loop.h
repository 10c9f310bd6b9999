// The engine on its own thread. HTTP threads never touch the Engine (nor tensors): they submit requests and
// aborts through a locked queue that the engine thread applies between steps, and receive each step's tokens
// through their RequestSink (which posts them to the connection's strand; a step never waits on a client).
// The thread steps back to back while there is work and sleeps on a condition variable when there is none.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "runtime/engine.h"
#include "server/metrics.h"

namespace chimera::server {

// One sequence's output of one step.
struct SeqEvent {
  int32_t choice = 0;  // index of the sequence within its request
  int32_t token = -1;  // -1: no token (finished without one, or aborted)
  FinishReason finish = FinishReason::kNone;
  bool aborted = false;  // finished by an abort (client gone, stop string, shutdown)
  // When the sequence asked for logprobs: the token's and the top ones (TokenEvent's).
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  std::string error;  // finish kError: why
  // The sequence's first event when it asked for prompt logprobs (TokenEvent's).
  std::vector<PromptLogprob> prompt_logprobs;
};

// Where a request's events go. Called on the engine thread; implementations only queue and return.
class RequestSink {
 public:
  virtual ~RequestSink() = default;
  virtual void on_events(std::vector<SeqEvent> events) = 0;
  // A sequence failed: the engine refused it (add_request threw; status 400 for input it calls invalid, else
  // 500) or its step failed (500). `message` says why.
  virtual void on_error(int status, std::string message) = 0;
};

struct SeqRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

struct EngineLoopConfig {
  // Sequences admitted past what the engine runs at once (--max-num-seqs); beyond, submit() -> 503.
  int32_t max_waiting_seqs = 1024;
  // Every interval with steps in it, one line of load and throughput (vLLM's periodic stats log):
  //   "Avg prompt throughput: 40960.0 tokens/s, Avg generation throughput: 9216.0 tokens/s, Running: 1024 reqs,
  //    Waiting: 0 reqs, KV cache usage: 41.3%, Steps: 52 (eager 12 x 210.4 ms, graph 40 x 58.1 ms)"
  // prompt tokens are those computed (chunks, recomputation after a preemption); a step's time is its wall time
  // on the engine thread, host work included. 0 turns it off (--disable-log-stats).
  double log_stats_interval_s = 10.0;
  std::function<void(const std::string&)> log;  // where the lines go; unset: standard output
};

class EngineLoop {
 public:
  EngineLoop(Engine& engine, Metrics& metrics, EngineLoopConfig config, int32_t max_num_seqs);
  ~EngineLoop();  // stop()
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues a request's sequences (choice i = seqs[i]); returns the handle of choice 0 (choice i has handle
  // first + i). Throws ApiError 503 when the queue bound is reached. `arrival`: when the request arrived.
  uint64_t submit(std::vector<SeqRequest> seqs, std::shared_ptr<RequestSink> sink,
                  std::chrono::steady_clock::time_point arrival);
  // Ends one sequence at the next step boundary (its slot and KV blocks are freed); unknown handles are ignored.
  // as_stop: the server ended it on a stop string (counted as finished_reason "stop", not "abort").
  void abort(uint64_t handle, bool as_stop = false);
  // Sequences submitted and not yet finished.
  int64_t in_flight() const;
  // Why the engine can run no more steps ("" while it can): set when a step failed and the model reports a failure
  // (Model::failure: a broken tensor-parallel group). From then on every request gets 503 and /health says so.
  std::string failure() const;
  // Ends the thread: every unfinished sequence is aborted (its sink sees the abort).
  void stop();

 private:
  struct Pending {
    uint64_t first_handle;
    std::vector<SeqRequest> seqs;
    std::shared_ptr<RequestSink> sink;
    std::chrono::steady_clock::time_point arrival;
  };
  struct Live {
    uint64_t handle;
    int32_t choice;
    std::shared_ptr<RequestSink> sink;
    std::chrono::steady_clock::time_point arrival, last_token;
    int32_t prompt_len;
    int32_t generated = 0;
    bool queue_time_recorded = false;
    double queue_seconds = 0.0;
  };
  void run();
  void apply_pending(std::deque<Pending>& adds, std::vector<std::pair<uint64_t, bool>>& aborts);
  void finish(int32_t seq_id, Live& live, FinishReason reason, bool aborted,
              std::unordered_map<RequestSink*, std::pair<std::shared_ptr<RequestSink>, std::vector<SeqEvent>>>& out);
  void update_gauges();
  // Adds the step that just ran (from step_start to now, `generated` tokens) and prints the stats line when due.
  void account_step(std::chrono::steady_clock::time_point step_start, std::chrono::steady_clock::time_point now,
                    int64_t generated);

  // Engine thread only: what the stats line sums since it was last printed.
  struct StepTotals {
    int64_t prompt_tokens = 0, generated = 0;
    int64_t eager_steps = 0, graph_steps = 0;
    double eager_seconds = 0.0, graph_seconds = 0.0;
  };
  StepTotals totals_;
  std::chrono::steady_clock::time_point stats_since_ = std::chrono::steady_clock::now();

  Engine& engine_;
  Metrics& metrics_;
  EngineLoopConfig config_;
  int32_t max_num_seqs_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<std::pair<uint64_t, bool>> pending_aborts_;
  uint64_t next_handle_ = 1;
  int64_t in_flight_ = 0;  // sequences submitted and not finished
  bool stopping_ = false;
  std::string failure_;  // Model::failure after a failed step

  // Engine thread only.
  std::unordered_map<int32_t, Live> live_;         // by engine sequence id
  std::unordered_map<uint64_t, int32_t> handles_;  // handle -> engine sequence id
  std::thread thread_;
};

}  // namespace chimera::server
