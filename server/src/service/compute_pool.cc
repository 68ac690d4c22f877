#include "service/compute_pool.h"

#include <pthread.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "remotehead/core/engine.h"

namespace remotehead::server {

ComputePool::ComputePool(int threads) {
  // Before any request can run LibTorch in parallel (here or on gRPC's threads: optimizer steps,
  // head creation), so that no first call races with MKL's one-time choice of kernels.
  core::WarmUpCpuMath();
  for (int i = 0; i < std::max(threads, 1); ++i) {
    threads_.emplace_back([this, i] {
      // Named, so that per-thread CPU time (top -H, remotehead-wire-bench) tells the compute
      // apart from gRPC's threads.
      pthread_setname_np(pthread_self(), absl::StrCat("rh-compute-", i).c_str());
      Run();
    });
  }
}

ComputePool::~ComputePool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  ready_.notify_all();
  for (auto& t : threads_) t.join();
}

void ComputePool::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  ready_.notify_one();
}

void ComputePool::Run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and nothing left to run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace remotehead::server
