// `comb serve`'s answers (serve_stream.hpp): server-sent events or one JSON body, with OpenAI's
// log-probability forms.
#include "serve_stream.hpp"

#include <httplib.h>

#include "comb/detail/json.hpp"
#include "comb/tokenizer.hpp"
#include "serve_api.hpp"

namespace comb::cli {

namespace {

using json = nlohmann::json;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json bytes_json(const std::string& b) {
  json a = json::array();
  for (unsigned char c : b) a.push_back(static_cast<int>(c));
  return a;
}

// OpenAI's chat form: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}.
json chat_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps) {
  json content = json::array();
  for (const auto& lp : lps) {
    const std::string b = tok.token_bytes(lp.token);
    json top = json::array();
    for (const auto& [id, v] : lp.top) {
      const std::string tb = tok.token_bytes(id);
      top.push_back({{"token", tb}, {"logprob", v}, {"bytes", bytes_json(tb)}});
    }
    content.push_back({{"token", b}, {"logprob", lp.logprob}, {"bytes", bytes_json(b)}, {"top_logprobs", top}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

// The completions form: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"};
// `offset`: the completion's bytes before these tokens (advanced past them).
json completion_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps, int64_t& offset, bool with_top) {
  json tokens = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (const auto& lp : lps) {
    const std::string b = tok.token_bytes(lp.token);
    tokens.push_back(b);
    values.push_back(lp.logprob);
    offsets.push_back(offset);
    offset += static_cast<int64_t>(b.size());
    json top = json::object();
    for (const auto& [id, v] : lp.top) top[tok.token_bytes(id)] = v;
    tops.push_back(top);
  }
  return {{"tokens", tokens}, {"token_logprobs", values}, {"top_logprobs", with_top ? tops : json(nullptr)},
          {"text_offset", offsets}};
}

json head(const Answer& a) {
  return json{{"id", a.id}, {"object", a.chat ? (a.stream ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
              {"created", a.created}, {"model", a.model}};
}

json usage(const ServeResult& s) {
  return json{{"prompt_tokens", s.prompt_tokens}, {"completion_tokens", s.tokens.size()},
              {"total_tokens", s.prompt_tokens + static_cast<int64_t>(s.tokens.size())},
              {"prompt_tokens_details", {{"cached_tokens", s.cached_tokens}}}};
}

// "stop" or "length"; a cancelled request has no client left to read its reason.
json finish_reason(const ServeResult& s) { return s.finish_reason; }

json extra(const ServeResult& s) {
  return json{{"method", method_name(s.method)}, {"computed_tokens", s.computed_tokens}, {"ttft_ms", s.ttft_ms},
              {"queue_ms", s.queue_ms}, {"total_ms", s.total_ms}};
}

// Waits for the engine (at most half a second): what it handed over since the last call.
bool wait(Channel& ch, std::deque<Piece>& pieces, std::optional<ServeResult>& result) {
  std::unique_lock<std::mutex> lock(ch.mutex);
  ch.cv.wait_for(lock, std::chrono::milliseconds(500), [&] { return !ch.pieces.empty() || ch.result; });
  pieces.swap(ch.pieces);
  result = ch.result;
  return !pieces.empty() || result;
}

void reply_events(httplib::Response& res, const Answer& a) {
  auto started = std::make_shared<bool>(false);
  auto offset = std::make_shared<int64_t>(0);  // completions' text_offset
  res.set_chunked_content_provider(
      "text/event-stream",
      [=](size_t, httplib::DataSink& sink) {
        auto send = [&](const json& j) {
          const std::string line = "data: " + dump(j) + "\n\n";
          return sink.write(line.data(), line.size());
        };
        auto choice = [&](const json& delta_or_text, json reason, const std::vector<TokenLogprob>* lps = nullptr) {
          json c = a.chat ? json{{"index", 0}, {"delta", delta_or_text}, {"finish_reason", reason}}
                          : json{{"index", 0}, {"text", delta_or_text}, {"finish_reason", reason}, {"logprobs", nullptr}};
          if (a.logprobs && lps)
            c["logprobs"] = a.chat ? chat_logprobs(*a.tokenizer, *lps) : completion_logprobs(*a.tokenizer, *lps, *offset, a.top);
          else if (a.chat)
            c["logprobs"] = nullptr;
          json j = head(a);
          j["choices"] = json::array({c});
          return j;
        };
        if (!*started) {
          *started = true;
          if (a.chat && !send(choice(json{{"role", "assistant"}, {"content", ""}}, nullptr))) return a.cancel(), false;
        }
        std::deque<Piece> pieces;
        std::optional<ServeResult> result;
        if (!wait(*a.channel, pieces, result)) {
          static const char probe[] = ": waiting\n\n";
          if (!sink.write(probe, sizeof(probe) - 1)) return a.cancel(), false;
          return true;
        }
        for (const auto& p : pieces)
          if (!send(choice(a.chat ? json{{"content", p.text}} : json(p.text), nullptr, &p.logprobs)))
            return a.cancel(), false;
        if (!result) return true;
        if (result->finish_reason == "error") {
          send({{"error", {{"message", result->error}, {"type", "internal_error"}}}});
        } else {
          json last = choice(a.chat ? json::object() : json(""), finish_reason(*result));
          last["comb"] = extra(*result);
          send(last);
          if (a.usage_chunk) {
            json u = head(a);
            u["choices"] = json::array();
            u["usage"] = usage(*result);
            send(u);
          }
        }
        static const char done[] = "data: [DONE]\n\n";
        sink.write(done, sizeof(done) - 1);
        sink.done();
        return true;
      },
      [a](bool success) {
        if (!success) a.cancel();
      });
}

void reply_body(httplib::Response& res, const Answer& a) {
  res.set_chunked_content_provider(
      "application/json",
      [a](size_t, httplib::DataSink& sink) {
        std::deque<Piece> pieces;
        std::optional<ServeResult> result;
        wait(*a.channel, pieces, result);
        if (!result) {
          if (!sink.write(" ", 1)) return a.cancel(), false;
          return true;
        }
        json body;
        if (result->finish_reason == "error") {
          body = json::parse(serve::error_body(serve::ApiError(500, "generation failed: " + result->error)));
        } else {
          body = head(a);
          json choice = a.chat ? json{{"index", 0},
                                      {"message", {{"role", "assistant"}, {"content", result->text}}},
                                      {"finish_reason", finish_reason(*result)}}
                               : json{{"index", 0}, {"text", result->text}, {"finish_reason", finish_reason(*result)}};
          int64_t offset = 0;
          choice["logprobs"] = !a.logprobs ? json(nullptr)
                               : a.chat    ? chat_logprobs(*a.tokenizer, result->logprobs)
                                           : completion_logprobs(*a.tokenizer, result->logprobs, offset, a.top);
          body["choices"] = json::array({choice});
          body["usage"] = usage(*result);
          body["comb"] = extra(*result);
        }
        const std::string text = dump(body);
        sink.write(text.data(), text.size());
        sink.done();
        return true;
      },
      [a](bool success) {
        if (!success) a.cancel();
      });
}

}  // namespace

void reply(httplib::Response& res, Answer answer) {
  if (answer.stream) reply_events(res, answer);
  else reply_body(res, answer);
}

}  // namespace comb::cli
