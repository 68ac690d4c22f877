#include "remotehead/server/service/head_description.h"

namespace remotehead::server {

HealthWindow HealthWindow::Of(const core::StepStats& stats) {
  HealthWindow w;
  if (stats.health.tokens == 0) return w;
  w.health = stats.health;
  if (const auto it = stats.extras.find("clipped"); it != stats.extras.end()) {
    w.clipped_sum = it->second;
    w.clipped_tokens = stats.health.tokens;
  }
  if (const auto it = stats.extras.find("kl"); it != stats.extras.end()) {
    w.kl_sum = it->second;
    w.kl_tokens = stats.health.tokens;
  }
  return w;
}

void HealthWindow::Add(const HealthWindow& other) {
  health.Add(other.health);
  clipped_sum += other.clipped_sum;
  clipped_tokens += other.clipped_tokens;
  kl_sum += other.kl_sum;
  kl_tokens += other.kl_tokens;
}

}  // namespace remotehead::server
