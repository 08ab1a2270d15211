// `comb serve`'s /metrics (serve_metrics.hpp).
#include "serve_metrics.hpp"

#include <fmt/format.h>

namespace comb::cli {

namespace {
// Prometheus text: one metric's HELP/TYPE lines.
void metric_head(std::string& out, const std::string& name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void histogram_text(std::string& out, const std::string& name, const char* help, const Histogram& h) {
  metric_head(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cumulative += h.counts[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds[i], cumulative);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, h.count, name, h.sum, name, h.count);
}
}  // namespace

void Metrics::count(const std::string& route, int status) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++counts_[{route, status}];
}

std::string Metrics::text(const ServeStats& s, const std::optional<GuardedServer::Counts>& connections) {
  std::string out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    metric_head(out, "comb_http_requests_total", "counter", "HTTP requests answered, by route and status");
    for (const auto& [key, n] : counts_)
      out += fmt::format("comb_http_requests_total{{route=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, n);
  }
  auto gauge = [&](const char* name, const char* help, double v) {
    metric_head(out, name, "gauge", help);
    out += fmt::format("{} {}\n", name, v);
  };
  auto counter = [&](const char* name, const char* help, double v) {
    metric_head(out, name, "counter", help);
    out += fmt::format("{} {}\n", name, v);
  };
  gauge("comb_requests_running", "Requests decoding", s.running);
  gauge("comb_requests_prefilling", "Requests whose prompt is being computed", s.prefilling);
  gauge("comb_requests_queued", "Requests waiting for room", s.queued);
  counter("comb_requests_finished_total", "Requests that ended with stop or length", s.finished);
  counter("comb_requests_cancelled_total", "Requests cancelled (client gone, shutdown)", s.cancelled);
  counter("comb_requests_failed_total", "Requests that failed inside the engine", s.failed);
  counter("comb_requests_refused_total", "Requests refused because the queue was full or the server stopping", s.refused);
  gauge("comb_kv_blocks_total", "Blocks of the K/V pool", s.blocks_total);
  gauge("comb_kv_blocks_free", "Free blocks of the K/V pool", s.blocks_free);
  gauge("comb_kv_block_tokens", "Tokens per block", s.block_tokens);
  gauge("comb_tokens_in_flight", "Prompt and completion tokens reserved by admitted requests", s.tokens_in_flight);
  counter("comb_prompt_tokens_total", "Prompt tokens, documents included", s.prompt_tokens);
  counter("comb_prompt_tokens_cached_total", "Prompt tokens whose K/V came from a cache", s.cached_tokens);
  counter("comb_prompt_tokens_computed_total", "Prompt tokens computed (decoder and encoder)", s.computed_tokens);
  counter("comb_generation_tokens_total", "Tokens generated", s.generated_tokens);
  counter("comb_decode_steps_total", "Batched decoding steps", s.decode_steps);
  counter("comb_decode_seconds_total", "Time inside batched decoding steps", s.decode_seconds);
  counter("comb_mixed_steps_total", "Decoding steps that computed a prompt's piece too", s.mixed_steps);
  counter("comb_mixed_tokens_total", "Prompt and document tokens computed inside decoding steps", s.mixed_tokens);
  counter("comb_mixed_document_tokens_total", "Documents' decoder-K/V tokens computed inside decoding steps",
          s.mixed_document_tokens);
  {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    const double dt = std::chrono::duration<double>(now - last_scrape_).count();
    const double rate = last_scrape_.time_since_epoch().count() == 0 || dt <= 0
                            ? 0.0
                            : (static_cast<double>(s.generated_tokens) - last_generated_) / dt;
    last_scrape_ = now;
    last_generated_ = static_cast<double>(s.generated_tokens);
    gauge("comb_generation_tokens_per_second", "Tokens generated per second since the previous scrape", rate);
  }
  histogram_text(out, "comb_time_to_first_token_seconds", "From arrival to the first token", s.ttft);
  histogram_text(out, "comb_inter_token_latency_seconds", "Between two tokens of a request", s.inter_token);
  histogram_text(out, "comb_decode_batch_size", "Sequences per decoding step", s.batch_size);
  const std::pair<const char*, const TierStats*> tiers[] = {
      {"host", &s.store.host}, {"disk", &s.store.disk}, {"remote", &s.store.remote}, {"device", &s.store.device}};
  metric_head(out, "comb_cache_hits_total", "counter", "Document cache hits by tier");
  for (auto& [t, st] : tiers) out += fmt::format("comb_cache_hits_total{{tier=\"{}\"}} {}\n", t, st->hits);
  metric_head(out, "comb_cache_misses_total", "counter", "Document cache misses by tier");
  for (auto& [t, st] : tiers) out += fmt::format("comb_cache_misses_total{{tier=\"{}\"}} {}\n", t, st->misses);
  metric_head(out, "comb_cache_bytes", "gauge", "Bytes held by tier");
  for (auto& [t, st] : tiers) out += fmt::format("comb_cache_bytes{{tier=\"{}\"}} {}\n", t, st->bytes);
  metric_head(out, "comb_cache_entries", "gauge", "Documents held by tier");
  for (auto& [t, st] : tiers) out += fmt::format("comb_cache_entries{{tier=\"{}\"}} {}\n", t, st->entries);
  metric_head(out, "comb_cache_evictions_total", "counter", "Documents evicted by tier");
  for (auto& [t, st] : tiers) out += fmt::format("comb_cache_evictions_total{{tier=\"{}\"}} {}\n", t, st->evictions);
  counter("comb_cache_corrupt_total", "Disk or Redis entries that failed their checks (dropped, recomputed)",
          s.store.corrupt);
  counter("comb_cache_write_errors_total", "Disk writes that failed (the entry not on disk)",
          s.store.write_errors);
  gauge("comb_cache_disk_queued", "Documents waiting to be written to the disk tier", s.store.disk_queued);
  gauge("comb_prefix_cache_bytes", "Bytes of the prefix cache", s.prefix_bytes);
  gauge("comb_prefix_cache_blocks", "Blocks of the prefix cache", s.prefix_blocks);
  if (connections) {
    const GuardedServer::Counts& c = *connections;
    gauge("comb_http_connections_open", "Connections being served", static_cast<double>(c.open));
    metric_head(out, "comb_http_refused_total", "counter", "Connections and requests refused before routing, by reason");
    for (auto [reason, n] : {std::pair<const char*, int64_t>{"max_connections", c.refused_busy},
                             {"max_per_client", c.refused_client},
                             {"request_timeout", c.timed_out},
                             {"request_too_large", c.too_large}})
      out += fmt::format("comb_http_refused_total{{reason=\"{}\"}} {}\n", reason, n);
  }
  return out;
}

}  // namespace comb::cli
