// A fixed set of threads that run the engine for streaming calls, so gRPC's callback threads
// only move bytes: while a pool thread computes one chunk of rows, the reactor keeps reading
// the next and writing the previous one's results.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace remotehead::server {

class ComputePool {
 public:
  explicit ComputePool(int threads);
  // Runs every task already submitted, then joins the threads.
  ~ComputePool();
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  // Tasks run in submission order (first come, first served across requests).
  void Submit(std::function<void()> task);

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace remotehead::server
