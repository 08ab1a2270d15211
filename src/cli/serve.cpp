// `comb serve`: an OpenAI-compatible HTTP server (cpp-httplib) over comb::ServeEngine, with
// documents as part of a request and an API to upload them ahead of requests.
#include <httplib.h>
#include <pthread.h>
#include <signal.h>

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ctime>
#include <mutex>
#include <thread>

#include "comb/detail/json.hpp"
#include "comb/detail/utf8.hpp"
#include "commands.hpp"
#include "serve_api.hpp"
#include "serve_http.hpp"
#include "serve_metrics.hpp"
#include "serve_stream.hpp"
#include "serve_uploads.hpp"

namespace comb::cli {

namespace {

using json = nlohmann::json;
using serve::ApiError;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

class Api {
 public:
  Api(const Model& model, ServeEngine& engine, std::vector<std::string> names, serve::Limits limits,
      int64_t default_max_tokens, bool log_requests, const std::string& cache_dir)
      : model_(model), engine_(engine), names_(std::move(names)), limits_(limits),
        default_max_tokens_(default_max_tokens), log_(log_requests), started_(std::time(nullptr)),
        uploads_(model, engine, cache_dir) {
    COMB_CHECK(!names_.empty(), "the server needs a model name");
  }

  std::atomic<bool> draining{false};
  std::function<GuardedServer::Counts()> connections;  // the HTTP server's, for /metrics

  void routes(httplib::Server& http, int64_t max_body_bytes, std::vector<std::string> allowed_origins) {
    // Before any body is read: a refused one is neither read nor waited for, and the connection
    // closes after the answer (its unread body would otherwise be read as the next request).
    http.set_pre_routing_handler([this, max_body_bytes, origins = std::move(allowed_origins)](
                                     const httplib::Request& req, httplib::Response& res) {
      auto header = [&](const char* name) -> std::optional<std::string> {
        if (!req.has_header(name)) return std::nullopt;
        return req.get_header_value(name);
      };
      try {
        serve::check_request_head({req.method, header("Content-Length"), header("Content-Type"),
                                   header("Transfer-Encoding"), header("Origin")},
                                  max_body_bytes, origins);
      } catch (const ApiError& e) {
        reply_error(res, e);
        res.set_header("Connection", "close");
        GuardedServer::close_after_response();  // its body, unread, must not be read as a request
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      if (draining) {
        res.status = 503;
        res.set_header("Retry-After", "5");
        res.set_content(R"({"status":"draining"})", "application/json");
      } else {
        res.set_content(R"({"status":"ok"})", "application/json");
      }
    });
    http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      json data = json::array();
      for (const auto& n : names_)  // the served name first, then its aliases
        data.push_back({{"id", n}, {"object", "model"}, {"created", started_}, {"owned_by", "comb"},
                        {"root", names_[0]}, {"max_model_len", model_.config().n_ctx}});
      res.set_content(dump({{"object", "list"}, {"data", data}}), "application/json");
    });
    http.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { tokenize(req, res); });
    });
    http.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { detokenize(req, res); });
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics(), "text/plain; version=0.0.4");
    });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { completion(req, res, true); });
    });
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { completion(req, res, false); });
    });
    http.Post("/v1/documents", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        if (draining) throw Overloaded("the server is shutting down");
        serve::DocumentUpload u = serve::parse_document_upload(req.body, limits_);
        res.set_content(dump(uploads_.upload(u, method_of(u.method))), "application/json");
      });
    });
    http.Get("/v1/documents", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { res.set_content(dump(uploads_.list(req.get_param_value("cache_salt"))), "application/json"); });
    });
    http.Get(R"(/v1/documents/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        res.set_content(dump(uploads_.get(req.get_param_value("cache_salt"), req.matches[1].str())), "application/json");
      });
    });
    http.Delete(R"(/v1/documents/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] {
        res.set_content(dump(uploads_.erase(req.get_param_value("cache_salt"), req.matches[1].str())), "application/json");
      });
    });
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;  // a handler's own error (its body was read whole)
      // httplib's own refusals (a malformed head, a body it could not read) leave the stream
      // where it stopped: the connection closes after them, and says so.
      if (res.status == 400 || res.status == 413 || res.status == 414 || res.status == 431) {
        GuardedServer::close_after_response();
        res.set_header("Connection", "close");
      }
      std::string message = fmt::format("{} {}: HTTP {}", req.method, req.path.substr(0, 200), res.status);
      if (res.status == 404) message = fmt::format("no route {} {}", req.method, req.path.substr(0, 200));
      if (res.status == 413) message = "the body is larger than this server takes";
      res.set_content(serve::error_body(ApiError(res.status, message)), "application/json");
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      res.status = 500;
      res.set_content(serve::error_body(ApiError(500, "internal error: " + what)), "application/json");
    });
    http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      static const char* known[] = {"/health", "/v1/models", "/metrics", "/v1/chat/completions", "/v1/completions",
                                    "/v1/documents", "/tokenize", "/detokenize"};
      std::string route = "other";
      for (const char* k : known)
        if (req.path == k) route = k;
      if (route == "other" && req.path.rfind("/v1/documents/", 0) == 0) route = "/v1/documents/{id}";
      metrics_.count(route, res.status);
      if (log_ && res.status >= 400) {
        const size_t cut = detail::utf8_cut(res.body, std::min<size_t>(res.body.size(), 400));
        try {
          fmt::print(stderr, "[serve] {} {} {} {}\n", req.method, route, res.status, res.body.substr(0, cut));
        } catch (...) {
        }
      }
    });
  }

 private:
  // Runs a handler; an ApiError (or a comb::Error about the request) becomes its JSON answer.
  void guarded(httplib::Response& res, const std::function<void()>& body) {
    try {
      body();
    } catch (const ApiError& e) {
      reply_error(res, e);
    } catch (const Overloaded& e) {
      reply_error(res, ApiError(draining ? 503 : 429, e.what(), "", draining ? "shutting_down" : "overloaded"));
    } catch (const Error& e) {
      const std::string m = e.what();
      reply_error(res, ApiError(400, m, "", m.find("context holds") != std::string::npos ? "context_length_exceeded" : ""));
    }
  }

  void reply_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    if (e.status == 429 || e.status == 503) res.set_header("Retry-After", "1");
    res.set_content(serve::error_body(e), "application/json");
  }

  Method method_of(const std::string& name) const {
    Method m = name.empty() ? engine_.options().method : parse_method(name);
    if (m == Method::comb && !model_.plugin())
      throw ApiError(400, "method comb needs a plug-in, and this server runs without one", "method");
    return m;
  }

  // A request's 'model': the served name or one of its aliases (--served-model-name).
  void check_model(const std::string& model) const {
    if (std::find(names_.begin(), names_.end(), model) == names_.end())
      throw ApiError(404, fmt::format("the model '{}' does not exist; this server serves '{}'", model.substr(0, 200),
                                      fmt::join(names_, "', '")), "model", "model_not_found");
  }

  // A completion's prompt text as token ids, the tokenizer's BOS first where it adds one and `bos`.
  std::vector<int32_t> prompt_tokens(const std::string& text, bool bos) const {
    const Tokenizer& tok = model_.tokenizer();
    std::vector<int32_t> ids = tok.encode(text);
    if (bos && tok.add_bos() && tok.bos_id() && (ids.empty() || ids[0] != *tok.bos_id()))
      ids.insert(ids.begin(), *tok.bos_id());
    return ids;
  }

  // Token ids a request gives (`param`): each inside the vocabulary, else a 400 naming it.
  std::vector<int32_t> vocabulary_ids(const std::vector<int64_t>& given, const std::string& param) const {
    const int64_t n_vocab = model_.tokenizer().n_vocab();
    std::vector<int32_t> ids;
    for (size_t i = 0; i < given.size(); ++i) {
      if (given[i] >= n_vocab)
        throw ApiError(400, fmt::format("{}[{}]: token id {} is outside the vocabulary of {}", param, i, given[i], n_vocab),
                       fmt::format("{}[{}]", param, i));
      ids.push_back(static_cast<int32_t>(given[i]));
    }
    return ids;
  }

  // Token ids of a prompt (as /v1/completions reads it) or of a chat (as /v1/chat/completions).
  void tokenize(const httplib::Request& req, httplib::Response& res) {
    const serve::TokenizeRequest t = serve::parse_tokenize_request(req.body, limits_);
    if (!t.model.empty()) check_model(t.model);
    const Tokenizer& tok = model_.tokenizer();
    const std::vector<int32_t> ids =
        t.chat ? model_.chat_prompt(t.messages, t.add_generation_prompt) : prompt_tokens(t.prompt, t.add_special);
    json j = {{"count", ids.size()}, {"max_model_len", model_.config().n_ctx}, {"tokens", ids}};
    if (t.return_token_strs) {
      json strs = json::array();
      for (int32_t id : ids) strs.push_back(tok.token_bytes(id));
      j["token_strs"] = strs;
    }
    res.set_content(dump(j), "application/json");
  }

  void detokenize(const httplib::Request& req, httplib::Response& res) {
    const serve::DetokenizeRequest d = serve::parse_detokenize_request(req.body, limits_);
    if (!d.model.empty()) check_model(d.model);
    res.set_content(dump({{"prompt", model_.tokenizer().decode(vocabulary_ids(d.tokens, "tokens"))}}), "application/json");
  }

  ServeRequest build(const serve::CompletionRequest& c, Method method) {
    const Tokenizer& tok = model_.tokenizer();
    check_model(c.model);
    ServeRequest r;
    r.method = method;
    r.prompt.tenant = c.cache_salt;
    for (size_t i = 0; i < c.documents.size(); ++i) r.prompt.documents.push_back(uploads_.tokens(c.documents[i], i, c.cache_salt));
    int64_t document_tokens = 0;
    for (const auto& d : r.prompt.documents) document_tokens += static_cast<int64_t>(d.size());
    if (document_tokens > limits_.max_request_document_tokens)
      throw ApiError(413, fmt::format("the documents hold {} tokens; this server takes at most {} a request "
                                      "(--max-request-document-tokens)",
                                      document_tokens, limits_.max_request_document_tokens),
                     "documents", "documents_too_large");
    const bool docs = !c.documents.empty();
    if (c.chat) {
      if (docs) {
        if (c.messages.size() != 1 || c.messages[0].role != "user")
          throw ApiError(400, "with documents, 'messages' should be one user message (the question)", "messages");
        r.prompt.prefix = qa_prefix(model_);
        r.prompt.suffix = qa_suffix(model_, c.messages[0].content);
      } else {
        r.prompt.suffix = model_.chat_prompt(c.messages);
      }
    } else {
      std::vector<int32_t> ids = c.prompt_is_ids ? vocabulary_ids(c.prompt_ids, "prompt") : prompt_tokens(c.prompt, true);
      if (docs && tok.add_bos() && tok.bos_id() && !ids.empty() && ids[0] == *tok.bos_id()) {
        r.prompt.prefix = {ids[0]};  // the documents come after it
        ids.erase(ids.begin());
        if (ids.empty()) throw ApiError(400, "'prompt' is empty", "prompt");
      }
      if (docs && model_.plugin() && model_.plugin()->config().documents_after_prefix) {
        // The served plug-in reads documents after the QA instruction (its encoder states assume
        // it): the documents follow that instruction for every method, then the prompt.
        r.prompt.prefix = qa_prefix(model_);
      }
      r.prompt.suffix = std::move(ids);
    }
    int64_t decoder = static_cast<int64_t>(r.prompt.prefix.size() + r.prompt.suffix.size());
    if (method != Method::comb)
      for (const auto& d : r.prompt.documents) decoder += static_cast<int64_t>(d.size());
    const int64_t room = model_.config().n_ctx - decoder;
    if (room < 1)
      throw ApiError(400, fmt::format("this model's context holds {} tokens; the prompt takes {} in the decoder",
                                      model_.config().n_ctx, decoder), "messages", "context_length_exceeded");
    r.max_tokens = c.max_tokens ? *c.max_tokens : std::min(default_max_tokens_, room);
    if (r.max_tokens > room)
      throw ApiError(400, fmt::format("this model's context holds {} tokens; the prompt takes {} in the decoder and "
                                      "max_tokens asks for {} more", model_.config().n_ctx, decoder, r.max_tokens),
                     "max_tokens", "context_length_exceeded");
    r.sampling.temperature = static_cast<float>(c.temperature);
    r.sampling.top_p = static_cast<float>(c.top_p);
    r.sampling.seed = c.seed ? *c.seed : std::random_device{}();
    r.stop = c.stop;
    r.ignore_eos = c.ignore_eos;
    r.logprobs = c.logprobs;
    r.top_logprobs = c.top_logprobs;
    return r;
  }

  void completion(const httplib::Request& req, httplib::Response& res, bool chat) {
    if (draining) throw Overloaded("the server is shutting down");
    serve::CompletionRequest c = serve::parse_completion_request(req.body, chat, limits_);
    const Method method = method_of(c.method);
    ServeRequest r = build(c, method);
    auto ch = std::make_shared<Channel>();
    if (c.stream)
      r.on_text = [ch](const std::string& piece, const std::vector<TokenLogprob>& logprobs) {
        std::lock_guard<std::mutex> lock(ch->mutex);
        ch->pieces.push_back({piece, logprobs});
        ch->cv.notify_all();
      };
    const std::string path = req.path;
    const bool log = log_;
    r.on_done = [ch, path, log](const ServeResult& result) {
      {
        std::lock_guard<std::mutex> lock(ch->mutex);
        ch->result = result;
        ch->cv.notify_all();
      }
      if (log) try {  // the log line after the answer: a failing stderr never holds a request
          fmt::print(stderr, "[serve] POST {} {} method={} prompt={} cached={} computed={} completion={} "
                     "ttft={:.0f}ms total={:.0f}ms\n", path, result.finish_reason, method_name(result.method),
                     result.prompt_tokens, result.cached_tokens, result.computed_tokens, result.tokens.size(),
                     result.ttft_ms, result.total_ms);
        } catch (...) {
        }
    };
    const ServeEngine::Id id = engine_.submit(std::move(r));
    Answer a;
    a.channel = ch;
    a.id = fmt::format("{}-{:x}{:06x}", chat ? "chatcmpl" : "cmpl", started_, id);
    a.model = names_.front();
    a.created = std::time(nullptr);
    a.chat = chat;
    a.stream = c.stream;
    a.usage_chunk = c.include_usage;
    a.logprobs = c.logprobs;
    a.top = !chat && c.top_logprobs > 0;
    a.tokenizer = &model_.tokenizer();
    a.cancel = [this, id] { engine_.cancel(id); };
    reply(res, std::move(a));
  }

  std::string metrics() { return metrics_.text(engine_.stats(), connections ? connections() : std::optional<GuardedServer::Counts>()); }

  const Model& model_;
  ServeEngine& engine_;
  std::vector<std::string> names_;  // the served name, then its aliases (at least one)
  serve::Limits limits_;
  int64_t default_max_tokens_;
  bool log_;
  int64_t started_;
  Uploads uploads_;
  Metrics metrics_;
};

}  // namespace

int cmd_serve(Args& args) {
  // SIGTERM and SIGINT go to one waiting thread (blocked here, before any thread starts).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  ServeOptions o;
  const std::string method = args.str("method");
  if (!method.empty()) o.method = parse_method(method);  // checked before the model loads
  o.pic.cache_bytes = args.num<int64_t>("cache-mb", 1024) << 20;
  o.pic.cache_url = args.str("cache-url");
  o.pic.cache_dtype = parse_cache_dtype(args.str("cache-dtype", "auto"));
  o.pic.cache_ttl_s = args.num<int64_t>("cache-ttl", 0);
  o.pic = pic_method_options(args, o.pic);
  COMB_CHECK(!args.has("comb-recompute-last") && !args.has("comb-recompute-linked"),
             "--comb-recompute-last and --comb-recompute-linked are options of comb eval and comb bench; the server "
             "links every document");
  o.cache_dir = args.str("cache-dir");
  o.cache_disk_bytes = o.pic.cache_bytes;  // --cache-mb bounds every tier, the disk's included
  o.cache_queue_bytes = cache_queue_bytes(args);
  const int64_t kv_mb = args.num<int64_t>("kv-mb", 0);
  COMB_CHECK(!args.has("kv-mb") || (kv_mb >= 1 && kv_mb <= (int64_t(1) << 30)),
             "--kv-mb should be 1 to 1073741824 (MiB), found {}", kv_mb);
  o.kv_bytes = kv_mb << 20;  // 0: sized by the engine (see ServeOptions)
  o.block_tokens = args.num<int64_t>("block-tokens", 16);
  o.max_running = args.num<int64_t>("max-running", 16);
  o.max_queued = args.num<int64_t>("max-queued", 64);
  o.max_tokens_in_flight = args.num<int64_t>("max-tokens-in-flight", 0);
  o.prefill_chunk = args.num<int64_t>("prefill-chunk", 0);  // 0: by the device (ServeOptions)
  o.piece_ms = args.num<double>("piece-ms", o.piece_ms);
  o.prefill_share = args.num<double>("prefill-share", o.prefill_share);
  o.mixed_step = args.num<int>("mixed-step", 1) != 0;
  serve::Limits limits;
  limits.max_documents = args.num<int64_t>("max-documents", 32);
  limits.max_request_document_tokens = args.num<int64_t>("max-request-document-tokens", limits.max_request_document_tokens);
  const std::string host = args.str("host", "127.0.0.1");
  const int64_t port64 = args.num<int64_t>("port", 8000);
  COMB_CHECK(port64 >= 0 && port64 <= 65535, "--port should be 0 to 65535, found {}", port64);
  const int port = static_cast<int>(port64);
  COMB_CHECK(o.max_running > 0, "--max-running should be at least 1, found {}", o.max_running);
  COMB_CHECK(o.max_queued >= 0, "--max-queued should be at least 0, found {}", o.max_queued);
  COMB_CHECK(!args.has("prefill-chunk") || o.prefill_chunk >= 1, "--prefill-chunk should be at least 1, found {}",
             o.prefill_chunk);
  COMB_CHECK(o.piece_ms >= 0 && o.piece_ms <= 1e6, "--piece-ms should be 0 to 1000000, found {}", o.piece_ms);
  COMB_CHECK(o.prefill_share >= 0 && o.prefill_share <= 1e6, "--prefill-share should be 0 to 1000000, found {}",
             o.prefill_share);
  COMB_CHECK(limits.max_documents >= 0, "--max-documents should be at least 0, found {}", limits.max_documents);
  COMB_CHECK(limits.max_request_document_tokens >= 1, "--max-request-document-tokens should be at least 1, found {}",
             limits.max_request_document_tokens);
  const int64_t drain_s = args.num<int64_t>("drain-timeout", 30);
  const bool log_requests = args.num<int>("log-requests", 1) != 0;
  // --served-model-name NAME[,ALIAS...] (or repeated): requests may name any; answers carry the first.
  std::vector<std::string> names;
  if (args.has("served-model-name"))
    for (const auto& v : args.all("served-model-name"))
      for (auto& n : split_items(v, "served-model-name")) {
        COMB_CHECK(n.size() <= 256, "--served-model-name: a name should have 1 to 256 bytes, found '{}' in '{}'", n, v);
        if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
      }
  if (names.empty())
    names.push_back(std::filesystem::path(args.has("model") ? args.peek_all("model").back() : default_model()).stem().string());
  const std::string name = names[0];
  const int64_t default_max_tokens = args.num<int64_t>("default-max-tokens", 256);
  const std::string port_file = args.str("port-file");
  ConnectionLimits connection_limits;
  connection_limits.max_connections = args.num<int64_t>("max-connections", connection_limits.max_connections);
  connection_limits.max_per_client = args.num<int64_t>("max-connections-per-client", connection_limits.max_per_client);
  connection_limits.request_timeout_s = args.num<double>("request-timeout", connection_limits.request_timeout_s);
  COMB_CHECK(connection_limits.max_connections >= 1 && connection_limits.max_connections <= 16384,
             "--max-connections should be 1 to 16384, found {}", connection_limits.max_connections);
  COMB_CHECK(connection_limits.max_per_client >= 1, "--max-connections-per-client should be at least 1, found {}",
             connection_limits.max_per_client);
  COMB_CHECK(connection_limits.request_timeout_s > 0 && connection_limits.request_timeout_s <= 3600,
             "--request-timeout should be above 0 and at most 3600 seconds, found {}", connection_limits.request_timeout_s);
  std::vector<std::string> allowed_origins;
  if (args.has("allowed-origins")) {
    const std::string list = args.str("allowed-origins");
    allowed_origins = split_items(list, "allowed-origins");
    for (const auto& origin : allowed_origins)
      COMB_CHECK(origin.size() <= 256,
                 "--allowed-origins: each origin should have 1 to 256 bytes (scheme://host:port, or *), found '{}' in '{}'",
                 origin, list);
  }
  Model model = load_model(args, true, /*as_stored=*/true);
  if (method.empty() && !model.plugin()) o.method = Method::naive;  // comb needs a plug-in
  args.check_all_used();

  ServeEngine engine(model, o);
  Api api(model, engine, names, limits, default_max_tokens, log_requests, o.cache_dir);
  GuardedServer http(connection_limits);
  api.connections = [&http] { return http.counts(); };
  const int64_t max_body_bytes = int64_t(8) << 20;
  http.set_payload_max_length(static_cast<size_t>(max_body_bytes));
  http.set_tcp_nodelay(true);  // each streamed token leaves at once
  api.routes(http, max_body_bytes, allowed_origins);
  const int bound = port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
  COMB_CHECK(bound > 0, "cannot listen on {}:{} (in use, or not an address of this machine)", host, port);
  if (!port_file.empty()) {
    std::ofstream f(port_file + ".tmp");
    f << bound << "\n";
    f.close();
    std::filesystem::rename(port_file + ".tmp", port_file);
  }
  fmt::print(stderr, "[serve] http://{}:{} model '{}' method {} ({}), {} {}, K/V pool {} blocks of {} tokens ({} MiB), "
             "up to {} running and {} queued, prompts in pieces of up to {} tokens\n", host, bound, name,
             method_name(o.method), model.plugin() ? "plug-in loaded" : "no plug-in", model.decoder().device().str(),
             c10::toString(model.decoder().dtype()), engine.stats().blocks_total, o.block_tokens,
             engine.options().kv_bytes >> 20, o.max_running, o.max_queued, engine.options().prefill_chunk);

  std::atomic<bool> listen_ended{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    if (listen_ended) return;  // woken by the main thread: the listener is gone already
    fmt::print(stderr, "[serve] {}: no new requests; finishing those in flight (at most {} s)\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT", drain_s);
    api.draining = true;
    // Requests still running after the drain time are cancelled.
    for (int64_t i = 0; i < drain_s * 10; ++i) {
      auto st = engine.stats();
      if (st.running + st.queued + st.prefilling == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    engine.shutdown(false);
    // stop() does nothing before the listener runs (a signal during loading): wait for it.
    while (!listen_ended && !http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    http.stop();
  });
  const bool ok = http.listen_after_bind();
  listen_ended = true;
  engine.shutdown(false);
  pthread_kill(waiter.native_handle(), SIGTERM);  // wakes sigwait if no signal came; else pending, unread
  waiter.join();
  fmt::print(stderr, "[serve] stopped\n");
  return ok ? 0 : 1;
}

}  // namespace comb::cli
