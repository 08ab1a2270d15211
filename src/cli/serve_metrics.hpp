#pragma once
// `comb serve`'s /metrics: the engine's statistics, the HTTP requests answered by route and status,
// and the connections refused, as Prometheus text.
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "comb/serving.hpp"
#include "serve_http.hpp"

namespace comb::cli {

class Metrics {
 public:
  // One request answered on `route` with `status`.
  void count(const std::string& route, int status);
  // The text of a scrape; the generation rate is over the time since the previous scrape.
  std::string text(const ServeStats& s, const std::optional<GuardedServer::Counts>& connections);

 private:
  std::mutex mutex_;
  std::map<std::pair<std::string, int>, uint64_t> counts_;
  std::chrono::steady_clock::time_point last_scrape_{};
  double last_generated_ = 0;
};

}  // namespace comb::cli
