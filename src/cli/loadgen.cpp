// `comb loadgen`: load for `comb serve`. Requests arrive as a Poisson process at each given rate;
// each is a streamed chat completion over one QA item's documents (in a random order: the items'
// documents are a pool that requests share, as in retrieval-augmented generation) with a caching
// method named per run. With --documents prompt the documents are written into the user message
// instead (the same text as comb's QA prompt), for any OpenAI-compatible server; the methods
// then only label the runs. With --concurrency the load is a closed loop instead: N clients, each
// sending its next request when its last is answered; with --prompt-words a request is a user
// message of that many words taken from the items' documents, with no documents of its own (a
// plain serving load). Prints completed requests/s, output tokens/s, time to first token p50 and
// p99 (measured by the client, to the first streamed token) and the share of prompt tokens read
// from a cache.
#include <httplib.h>

#include <atomic>
#include <cmath>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "comb/detail/json.hpp"
#include "commands.hpp"

namespace comb::cli {

namespace {

using json = nlohmann::json;
using clock_type = std::chrono::steady_clock;

struct Outcome {
  int status = 0;
  double ttft_s = -1, total_s = 0;
  int64_t completion = 0, prompt = 0, cached = 0;
  std::string error;
};

// One streamed request; the time to the first chunk that carries text or an end.
Outcome one_request(const std::string& host, int port, const std::string& body) {
  Outcome out;
  httplib::Client cli(host, port);
  cli.set_tcp_nodelay(true);
  cli.set_read_timeout(600, 0);
  cli.set_connection_timeout(10, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = body;
  const auto t0 = clock_type::now();
  std::string buffer, raw;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    if (raw.size() < 2000) raw.append(data, std::min<size_t>(n, 2000));
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      json j;
      try {  // a server's event that is not JSON, or nested past the bound, is skipped
        j = comb::detail::parse_json(event.substr(6), "event", /*invalid_ok=*/true);
      } catch (const comb::Error&) {
        continue;
      }
      if (j.is_discarded() || !j.is_object()) continue;
      try {  // another server's fields may be null or of other types: read what is there
        if (j.contains("usage") && j["usage"].is_object()) {
          const json& u = j["usage"];
          if (u.contains("completion_tokens") && u["completion_tokens"].is_number()) out.completion = u["completion_tokens"];
          if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number()) out.prompt = u["prompt_tokens"];
          if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object() &&
              u["prompt_tokens_details"].contains("cached_tokens") && u["prompt_tokens_details"]["cached_tokens"].is_number())
            out.cached = u["prompt_tokens_details"]["cached_tokens"];
        }
      } catch (const json::exception&) {
      }
      if (j.contains("error")) out.error = j["error"].dump();
      if (out.ttft_s < 0 && j.contains("choices") && j["choices"].is_array() && !j["choices"].empty() &&
          j["choices"][0].is_object()) {
        const json& c = j["choices"][0];
        const bool text = c.contains("delta") && c["delta"].contains("content") && c["delta"]["content"].is_string() &&
                          !c["delta"]["content"].get<std::string>().empty();
        if (text || (c.contains("finish_reason") && !c["finish_reason"].is_null()))
          out.ttft_s = std::chrono::duration<double>(clock_type::now() - t0).count();
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool ok = cli.send(req, res, err);
  out.total_s = std::chrono::duration<double>(clock_type::now() - t0).count();
  out.status = ok ? res.status : 0;
  if (!ok) out.error = httplib::to_string(err);
  else if (res.status != 200) out.error = raw.empty() ? res.body : raw;
  return out;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double at = p * double(v.size() - 1);
  const size_t lo = static_cast<size_t>(at), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - double(lo));
}

}  // namespace

int cmd_loadgen(Args& args) {
  const std::string host = args.str("host", "127.0.0.1");
  const int port = static_cast<int>(args.num<int64_t>("port", 8000));
  const std::string data = args.str("data");
  COMB_CHECK(!data.empty(), "--data FILE (QA items, e.g. nq-multidoc-10.dev.jsonl.gz) is required");
  const int64_t pool = args.num<int64_t>("items", 20);
  const double duration = args.num<double>("duration", 30);
  const int64_t max_tokens = args.num<int64_t>("max-tokens", 16);
  const uint64_t seed = args.num<uint64_t>("seed", 0);
  const double temperature = args.num<double>("temperature", 0);  // 0: greedy
  COMB_CHECK(temperature >= 0 && temperature <= 2, "--temperature: expected 0 (greedy) to 2, found {}", temperature);
  std::string model = args.str("served-model-name");
  const bool warm = args.num<int>("warm", 1) != 0;
  const bool json_out = args.has("json");
  if (json_out) args.str("json");
  // A run's load: a Poisson rate (requests/s), or with --concurrency a number of closed-loop clients.
  const bool closed = args.has("concurrency");
  COMB_CHECK(!(closed && args.has("rates")), "--rates (Poisson arrivals) and --concurrency (closed-loop clients) "
             "exclude each other: give one");
  std::vector<double> rates;
  for (const auto& r : split_items(closed ? args.str("concurrency") : args.str("rates", "1"), closed ? "concurrency" : "rates")) {
    char* end = nullptr;
    const double v = std::strtod(r.c_str(), &end);
    if (closed)
      COMB_CHECK(end && *end == 0 && v >= 1 && v <= 1024 && v == std::floor(v),
                 "--concurrency: each count of clients (comma-separated) should be a whole number from 1 to 1024, "
                 "found '{}'", r);
    else
      COMB_CHECK(end && *end == 0 && std::isfinite(v) && v > 0,
                 "--rates: each rate (requests per second, comma-separated) should be a number above 0, found '{}'", r);
    rates.push_back(v);
  }
  COMB_CHECK(!rates.empty(), "--{}: no value given", closed ? "concurrency" : "rates");
  const int64_t prompt_words = args.num<int64_t>("prompt-words", 0);
  COMB_CHECK(prompt_words >= 0 && prompt_words <= 100000, "--prompt-words should be 0 to 100000, found {}",
             prompt_words);
  const std::string documents = args.str("documents", "field");
  COMB_CHECK(documents == "field" || documents == "prompt",
             "--documents should be field (comb's documents and method fields) or prompt (the documents written into "
             "the message, for any OpenAI-compatible server), found '{}'", documents);
  const bool in_prompt = documents == "prompt";
  COMB_CHECK(!(in_prompt && prompt_words > 0), "--prompt-words writes no documents: --documents prompt does not apply");
  const std::vector<std::string> methods =
      split_items(args.str("methods", in_prompt ? "prompt" : prompt_words > 0 ? "full" : "comb,prefix"), "methods");
  args.check_all_used();
  COMB_CHECK(duration > 0, "--duration should be above 0 seconds, found {}", duration);

  if (model.empty()) {  // the server's one model
    httplib::Client cli(host, port);
    auto res = cli.Get("/v1/models");
    COMB_CHECK(res && res->status == 200, "no server answers on {}:{} (GET /v1/models: {})", host, port,
               res ? std::to_string(res->status) : httplib::to_string(res.error()));
    json j = comb::detail::parse_json(res->body, "GET /v1/models", /*invalid_ok=*/true);
    COMB_CHECK(!j.is_discarded() && j.contains("data") && !j["data"].empty(), "GET /v1/models: no model in '{}'",
               res->body.substr(0, 200));
    model = j["data"][0].value("id", "");
  }
  std::vector<QaItem> items = read_qa_items(data, pool);
  COMB_CHECK(!items.empty(), "'{}' has no items", data);
  std::vector<std::string> words;  // --prompt-words: the items' documents' words, in order
  if (prompt_words > 0) {
    for (const auto& item : items)
      for (const auto& doc : item.documents) {
        std::istringstream in(doc.text);
        for (std::string w; in >> w;) words.push_back(w);
      }
    COMB_CHECK(!words.empty(), "--prompt-words: the items of '{}' have no document text to take words from", data);
  }
  auto body_for = [&](const QaItem& item, const std::string& method, std::mt19937_64& rng) {
    std::vector<QaDocument> docs = item.documents;
    std::shuffle(docs.begin(), docs.end(), rng);
    json j = {{"model", model}, {"max_tokens", max_tokens}, {"temperature", temperature}, {"stream", true},
              {"stream_options", {{"include_usage", true}}}};
    if (prompt_words > 0) {  // N words from a random place, wrapping around
      const size_t at = std::uniform_int_distribution<size_t>(0, words.size() - 1)(rng);
      std::string text;
      for (int64_t i = 0; i < prompt_words; ++i) {
        if (i) text += ' ';
        text += words[(at + static_cast<size_t>(i)) % words.size()];
      }
      j["messages"] = json::array({{{"role", "user"}, {"content", text}}});
      j["method"] = method;
    } else if (in_prompt) {  // the text comb's QA prompt holds, in one user message: instruction, documents, question
      std::string text = std::string(kQaInstruction) + "\n\n";
      for (const auto& doc : docs) text += Documents::text(doc);
      text += qa_question_text(item.question);
      j["messages"] = json::array({{{"role", "user"}, {"content", text}}});
    } else {
      json d = json::array();
      for (const auto& doc : docs) d.push_back({{"title", doc.title}, {"text", doc.text}});
      j["messages"] = json::array({{{"role", "user"}, {"content", item.question}}});
      j["documents"] = d;
      j["method"] = method;
    }
    return j.dump();
  };
  if (prompt_words > 0)
    fmt::print(stderr, "[loadgen] prompts of {} words from the documents of {} items of {}", prompt_words, items.size(),
               data_name(data));
  else
    fmt::print(stderr, "[loadgen] {} items of {} as the document pool", items.size(), data_name(data));
  fmt::print(stderr, "; {} s per run; methods {}; {} {}\n", duration, fmt::join(methods, ","),
             closed ? "clients" : "rates", fmt::join(rates, ","));
  if (!json_out)
    fmt::print("{:<8} {:>6} {:>5} {:>5} {:>4} {:>8} {:>8} {:>9} {:>9} {:>7} {:>7}\n", "method", closed ? "conc" : "rate",
               "sent", "done", "err", "req/s", "tok/s", "ttft_p50", "ttft_p99", "cached", "prompt");
  for (const auto& method : methods) {
    std::mt19937_64 rng(seed);
    if (warm) {  // every item once, one at a time: the caches a server has after a while
      for (const auto& item : items) {
        Outcome o = one_request(host, port, body_for(item, method, rng));
        COMB_CHECK(o.status == 200 && o.error.empty(), "warm-up request for method {} failed: HTTP {} {}", method,
                   o.status, o.error.substr(0, 300));
      }
    }
    for (double rate : rates) {
      std::exponential_distribution<double> gap(rate);
      std::uniform_int_distribution<size_t> pick(0, items.size() - 1);
      std::mutex mutex;
      std::vector<Outcome> outcomes;
      std::vector<std::thread> threads;
      const auto start = clock_type::now();
      if (closed) {  // each client sends its next request when its last is answered, until the duration
        const auto end = start + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(duration));
        for (int c = 0; c < static_cast<int>(rate); ++c) {
          std::mt19937_64 own(rng());  // a client's own draws: the threads share no generator
          threads.emplace_back([&, own, pick, end]() mutable {
            while (clock_type::now() < end) {
              std::string body = body_for(items[pick(own)], method, own);
              Outcome o = one_request(host, port, body);
              const bool failed = o.status != 200 || !o.error.empty();
              {
                std::lock_guard<std::mutex> lock(mutex);
                outcomes.push_back(o);
              }
              // A refused or failed request (429 past the server's queue, a lost server) is not sent
              // again at once: a second, the Retry-After comb serve names, or the run's end.
              if (failed) std::this_thread::sleep_until(std::min(end, clock_type::now() + std::chrono::seconds(1)));
            }
          });
        }
      } else {
        double at = gap(rng);
        while (at < duration) {
          std::this_thread::sleep_until(start + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(at)));
          std::string body = body_for(items[pick(rng)], method, rng);
          threads.emplace_back([&, body] {
            Outcome o = one_request(host, port, body);
            std::lock_guard<std::mutex> lock(mutex);
            outcomes.push_back(o);
          });
          at += gap(rng);
        }
      }
      for (auto& t : threads) t.join();
      const double elapsed = std::chrono::duration<double>(clock_type::now() - start).count();
      std::vector<double> ttft;
      int64_t done = 0, errors = 0, tokens = 0, prompt = 0, cached = 0;
      std::map<int, int64_t> statuses;
      std::string first_error;
      for (const auto& o : outcomes) {
        ++statuses[o.status];
        if (o.status == 200 && o.error.empty() && o.ttft_s >= 0) {
          ++done;
          ttft.push_back(o.ttft_s);
          tokens += o.completion;
          prompt += o.prompt;
          cached += o.cached;
        } else {
          ++errors;
          if (first_error.empty()) first_error = fmt::format("HTTP {} {}", o.status, o.error.substr(0, 300));
        }
      }
      const double req_s = done / elapsed, tok_s = tokens / elapsed;
      const double p50 = percentile(ttft, 0.5), p99 = percentile(ttft, 0.99);
      const double hit = prompt > 0 ? double(cached) / double(prompt) : 0;
      const double prompt_mean = done > 0 ? double(prompt) / double(done) : 0;
      if (json_out) {
        json st = json::object();
        for (auto& [k, v] : statuses) st[std::to_string(k)] = v;
        fmt::print("{}\n", json{{"method", method}, {closed ? "concurrency" : "rate", closed ? json(static_cast<int64_t>(rate)) : json(rate)}, {"sent", outcomes.size()},
                                {"completed", done}, {"prompt_tokens_mean", prompt_mean},
                                {"errors", errors}, {"statuses", st}, {"elapsed_s", elapsed},
                                {"requests_per_s", req_s}, {"output_tokens_per_s", tok_s}, {"ttft_p50_s", p50},
                                {"ttft_p99_s", p99}, {"cache_hit_ratio", hit}}
                               .dump());
      } else {
        fmt::print("{:<8} {:>6.{}f} {:>5} {:>5} {:>4} {:>8.2f} {:>8.1f} {:>8.3f}s {:>8.3f}s {:>6.1f}% {:>7.0f}\n", method,
                   rate, closed ? 0 : 2, outcomes.size(), done, errors, req_s, tok_s, p50, p99, 100 * hit, prompt_mean);
      }
      std::fflush(stdout);
      if (!first_error.empty())
        fmt::print(stderr, "[loadgen] {} at {}{}: first failure: {}\n", method, rate, closed ? " clients" : "/s",
                   first_error);
    }
  }
  return 0;
}

}  // namespace comb::cli
