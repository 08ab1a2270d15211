// Request bodies of `comb serve` parsed and checked (see serve_api.hpp).
#include "serve_api.hpp"

#include "comb/detail/json.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <limits>

namespace comb::serve {

namespace {

using json = nlohmann::json;

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

[[noreturn]] void bad(const std::string& param, const std::string& message) { throw ApiError(400, message, param); }

void expect(bool ok, const std::string& param, const std::string& message) {
  if (!ok) bad(param, message);
}

std::string string_field(const json& v, const std::string& param, int64_t max_bytes) {
  expect(v.is_string(), param, fmt::format("'{}' should be a string, found {}", param, type_name(v)));
  const auto& s = v.get_ref<const std::string&>();
  expect(static_cast<int64_t>(s.size()) <= max_bytes, param,
         fmt::format("'{}' has {} bytes; at most {} are taken", param, s.size(), max_bytes));
  return s;
}

double number_field(const json& v, const std::string& param, double lo, double hi) {
  expect(v.is_number(), param, fmt::format("'{}' should be a number, found {}", param, type_name(v)));
  const double d = v.get<double>();
  expect(std::isfinite(d) && d >= lo && d <= hi, param,
         fmt::format("'{}' should be between {} and {}, found {}", param, lo, hi, v.dump()));
  return d;
}

int64_t integer_field(const json& v, const std::string& param, int64_t lo, int64_t hi) {
  expect(v.is_number_integer() || v.is_number_unsigned(), param,
         fmt::format("'{}' should be an integer, found {}", param,
                     v.is_number_float() ? "the number " + v.dump() : std::string(type_name(v))));
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    bad(param, fmt::format("'{}' should be between {} and {}, found {}", param, lo, hi, v.dump()));
  const int64_t i = v.get<int64_t>();
  expect(i >= lo && i <= hi, param, fmt::format("'{}' should be between {} and {}, found {}", param, lo, hi, i));
  return i;
}

bool bool_field(const json& v, const std::string& param) {
  expect(v.is_boolean(), param, fmt::format("'{}' should be true or false, found {}", param, type_name(v)));
  return v.get<bool>();
}

json parse_object(const std::string& body) {
  json j;
  try {
    j = comb::detail::parse_json(body, "the body");
  } catch (const comb::Error& e) {  // syntax (the byte and the token found), depth, a number beyond a double's range
    throw ApiError(400, e.what());
  }
  expect(j.is_object(), "", fmt::format("the body should be a JSON object, found {}", type_name(j)));
  return j;
}

// A field the endpoint does not take is refused by name (as OpenAI does), not ignored.
void refuse_unknown_fields(const json& j, const std::vector<const char*>& known) {
  for (const auto& [key, value] : j.items()) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    const std::string name = key.substr(0, 64);
    expect(ok, name, fmt::format("'{}' is not a field this endpoint takes (it takes {})", name, fmt::join(known, ", ")));
  }
}

// A message's content: a string, or OpenAI's list of parts of which only text parts are taken.
std::string content_text(const json& v, const std::string& param, int64_t max_bytes) {
  if (v.is_string()) return string_field(v, param, max_bytes);
  expect(v.is_array(), param, fmt::format("'{}' should be a string or a list of text parts, found {}", param, type_name(v)));
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string p = fmt::format("{}[{}]", param, i);
    const json& part = v[i];
    expect(part.is_object(), p, fmt::format("'{}' should be an object, found {}", p, type_name(part)));
    expect(part.contains("type") && part["type"] == "text", p,
           fmt::format("'{}' should be a part of type \"text\" (the only kind this model reads)", p));
    expect(part.contains("text"), p, fmt::format("'{}' has no 'text'", p));
    out += string_field(part["text"], p + ".text", max_bytes);
    expect(static_cast<int64_t>(out.size()) <= max_bytes, param,
           fmt::format("'{}' has more than {} bytes", param, max_bytes));
  }
  return out;
}

// OpenAI's 'messages': a list of {"role", "content"} (roles system, developer, user, assistant).
std::vector<ChatMessage> parse_messages(const json& m, const Limits& limits) {
  std::vector<ChatMessage> out;
  expect(m.is_array(), "messages", fmt::format("'messages' should be a list, found {}", type_name(m)));
  expect(!m.empty(), "messages", "'messages' is empty");
  expect(static_cast<int64_t>(m.size()) <= limits.max_messages, "messages",
         fmt::format("'messages' has {} entries; at most {} are taken", m.size(), limits.max_messages));
  int64_t bytes = 0;
  for (size_t i = 0; i < m.size(); ++i) {
    const std::string p = fmt::format("messages[{}]", i);
    expect(m[i].is_object(), p, fmt::format("'{}' should be an object, found {}", p, type_name(m[i])));
    expect(m[i].contains("role"), p + ".role", fmt::format("'{}' has no 'role'", p));
    std::string role = string_field(m[i]["role"], p + ".role", 64);
    if (role == "developer") role = "system";
    expect(role == "system" || role == "user" || role == "assistant", p + ".role",
           fmt::format("'{}.role' should be system, user or assistant, found '{}'", p, role));
    expect(m[i].contains("content") && !m[i]["content"].is_null(), p + ".content",
           fmt::format("'{}' has no 'content'", p));
    std::string content = content_text(m[i]["content"], p + ".content", limits.max_prompt_bytes);
    bytes += static_cast<int64_t>(content.size());
    expect(bytes <= limits.max_prompt_bytes, "messages",
           fmt::format("the messages have more than {} bytes", limits.max_prompt_bytes));
    out.push_back({role, std::move(content)});
  }
  return out;
}

}  // namespace

std::string ApiError::default_type(int status) {
  if (status == 401) return "authentication_error";
  if (status == 404) return "not_found_error";
  if (status == 429) return "rate_limit_exceeded";
  if (status == 503) return "service_unavailable";
  if (status >= 500) return "internal_error";
  return "invalid_request_error";
}

std::string error_body(const ApiError& e) {
  json err = {{"message", e.what()},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return json{{"error", err}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

bool known_method(const std::string& name) {
  for (const char* m : {"full", "prefix", "naive", "cacheblend", "epic", "comb"})
    if (name == m) return true;
  return false;
}

CompletionRequest parse_completion_request(const std::string& body, bool chat, const Limits& limits) {
  json j = parse_object(body);
  // OpenAI's fields this server reads (those it does not implement are refused below unless given
  // their neutral value), and comb's own: anything else is a 400 naming it, not silently ignored.
  static const std::vector<const char*> common = {
      "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
      "stream_options", "n", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "logit_bias",
      "user", "method", "cache_salt", "ignore_eos", "documents"};
  static const std::vector<const char*> chat_only = {"messages", "tools", "functions", "tool_choice",
                                                      "parallel_tool_calls", "response_format"};
  static const std::vector<const char*> completion_only = {"prompt", "echo", "suffix", "best_of"};
  std::vector<const char*> known = common;
  for (const char* k : chat ? chat_only : completion_only) known.push_back(k);
  refuse_unknown_fields(j, known);
  CompletionRequest r;
  r.chat = chat;
  expect(j.contains("model"), "model", "'model' is required");
  r.model = string_field(j["model"], "model", 512);
  if (chat) {
    expect(j.contains("messages"), "messages", "'messages' is required");
    r.messages = parse_messages(j["messages"], limits);
  } else {
    expect(j.contains("prompt"), "prompt", "'prompt' is required");
    const json& p = j["prompt"];
    if (p.is_string()) {
      r.prompt = string_field(p, "prompt", limits.max_prompt_bytes);
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      r.prompt = string_field(p[0], "prompt[0]", limits.max_prompt_bytes);
    } else if (p.is_array() && !p.empty() && (p[0].is_number() || p[0].is_array())) {
      expect(!p[0].is_array(), "prompt", "one prompt per request: 'prompt' should be a string or a list of token ids");
      expect(static_cast<int64_t>(p.size()) <= limits.max_prompt_bytes, "prompt", "'prompt' has too many token ids");
      for (size_t i = 0; i < p.size(); ++i)
        r.prompt_ids.push_back(integer_field(p[i], fmt::format("prompt[{}]", i), 0, std::numeric_limits<int32_t>::max()));
      r.prompt_is_ids = true;
    } else {
      bad("prompt", fmt::format("'prompt' should be a string or a list of token ids, found {}",
                                p.is_array() ? (p.empty() ? "an empty list" : "a list of several prompts") : type_name(p)));
    }
    if (!r.prompt_is_ids) expect(!r.prompt.empty(), "prompt", "'prompt' is empty");
    if (j.contains("echo") && !j["echo"].is_null()) expect(!bool_field(j["echo"], "echo"), "echo", "'echo' is not supported");
    if (j.contains("suffix") && !j["suffix"].is_null()) bad("suffix", "'suffix' is not supported");
  }
  for (const char* key : {"max_tokens", "max_completion_tokens"})
    if (j.contains(key) && !j[key].is_null()) r.max_tokens = integer_field(j[key], key, 1, int64_t(1) << 40);
  if (j.contains("temperature") && !j["temperature"].is_null())
    r.temperature = number_field(j["temperature"], "temperature", 0, 2);
  if (j.contains("top_p") && !j["top_p"].is_null()) r.top_p = number_field(j["top_p"], "top_p", 0, 1);
  expect(r.top_p > 0, "top_p", "'top_p' should be above 0");
  if (j.contains("seed") && !j["seed"].is_null())
    r.seed = static_cast<uint64_t>(
        integer_field(j["seed"], "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
  if (j.contains("stop") && !j["stop"].is_null()) {
    const json& s = j["stop"];
    if (s.is_string()) {
      r.stop.push_back(string_field(s, "stop", 256));
    } else {
      expect(s.is_array(), "stop", fmt::format("'stop' should be a string or a list of strings, found {}", type_name(s)));
      expect(static_cast<int64_t>(s.size()) <= limits.max_stop, "stop",
             fmt::format("'stop' has {} strings; at most {} are taken", s.size(), limits.max_stop));
      for (size_t i = 0; i < s.size(); ++i) r.stop.push_back(string_field(s[i], fmt::format("stop[{}]", i), 256));
    }
    for (const auto& s2 : r.stop) expect(!s2.empty(), "stop", "'stop' holds an empty string");
  }
  if (j.contains("stream") && !j["stream"].is_null()) r.stream = bool_field(j["stream"], "stream");
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const json& o = j["stream_options"];
    expect(o.is_object(), "stream_options", fmt::format("'stream_options' should be an object, found {}", type_name(o)));
    if (o.contains("include_usage") && !o["include_usage"].is_null())
      r.include_usage = bool_field(o["include_usage"], "stream_options.include_usage");
  }
  if (j.contains("n") && !j["n"].is_null()) expect(integer_field(j["n"], "n", 1, 128) == 1, "n", "'n' above 1 is not supported");
  if (j.contains("best_of") && !j["best_of"].is_null())
    expect(integer_field(j["best_of"], "best_of", 1, 128) == 1, "best_of", "'best_of' above 1 is not supported");
  if (j.contains("logprobs") && !j["logprobs"].is_null()) {
    // chat: true/false (with top_logprobs for alternatives); completions: how many alternatives
    const json& l = j["logprobs"];
    if (chat) {
      r.logprobs = bool_field(l, "logprobs");
    } else {
      r.top_logprobs = integer_field(l, "logprobs", 0, kMaxTopLogprobs);
      r.logprobs = true;
    }
  }
  if (j.contains("top_logprobs") && !j["top_logprobs"].is_null()) {
    expect(chat, "top_logprobs", "'top_logprobs' is a chat field; completions take 'logprobs': N");
    r.top_logprobs = integer_field(j["top_logprobs"], "top_logprobs", 0, kMaxTopLogprobs);
    expect(r.logprobs || r.top_logprobs == 0, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  for (const char* key : {"frequency_penalty", "presence_penalty"})
    if (j.contains(key) && !j[key].is_null())
      expect(number_field(j[key], key, -2, 2) == 0, key, fmt::format("'{}' other than 0 is not supported", key));
  if (j.contains("logit_bias") && !j["logit_bias"].is_null()) {
    const json& b = j["logit_bias"];
    expect(b.is_object(), "logit_bias", fmt::format("'logit_bias' should be an object, found {}", type_name(b)));
    expect(b.empty(), "logit_bias", "'logit_bias' is not supported");
  }
  if (j.contains("response_format") && !j["response_format"].is_null()) {
    const json& f = j["response_format"];
    expect(f.is_object() && f.contains("type") && f["type"].is_string(), "response_format",
           fmt::format("'response_format' should be an object with a 'type', found {}", type_name(f)));
    expect(f["type"] == "text", "response_format", "'response_format' other than {\"type\": \"text\"} is not supported");
  }
  if (j.contains("user") && !j["user"].is_null()) string_field(j["user"], "user", 256);
  if (j.contains("tool_choice") && !j["tool_choice"].is_null())
    expect(j["tool_choice"] == "none" || j["tool_choice"] == "auto", "tool_choice", "'tool_choice' is not supported");
  if (j.contains("parallel_tool_calls") && !j["parallel_tool_calls"].is_null())
    bool_field(j["parallel_tool_calls"], "parallel_tool_calls");
  for (const char* key : {"tools", "functions"})
    if (j.contains(key) && !j[key].is_null() && !(j[key].is_array() && j[key].empty()))
      bad(key, fmt::format("'{}' is not supported by this model", key));
  if (j.contains("method") && !j["method"].is_null()) {
    r.method = string_field(j["method"], "method", 32);
    expect(known_method(r.method), "method",
           fmt::format("'method' should be full, prefix, naive, cacheblend, epic or comb, found '{}'", r.method));
  }
  if (j.contains("cache_salt") && !j["cache_salt"].is_null())
    r.cache_salt = string_field(j["cache_salt"], "cache_salt", limits.max_salt_bytes);
  if (j.contains("ignore_eos") && !j["ignore_eos"].is_null()) r.ignore_eos = bool_field(j["ignore_eos"], "ignore_eos");
  if (j.contains("documents") && !j["documents"].is_null()) {
    const json& d = j["documents"];
    expect(d.is_array(), "documents", fmt::format("'documents' should be a list, found {}", type_name(d)));
    expect(static_cast<int64_t>(d.size()) <= limits.max_documents, "documents",
           fmt::format("'documents' has {} entries; at most {} are taken", d.size(), limits.max_documents));
    for (size_t i = 0; i < d.size(); ++i) {
      const std::string p = fmt::format("documents[{}]", i);
      expect(d[i].is_object(), p, fmt::format("'{}' should be an object, found {}", p, type_name(d[i])));
      DocumentRef ref;
      for (const auto& [key, value] : d[i].items())
        expect(key == "id" || key == "text" || key == "title", p + "." + key.substr(0, 64),
               fmt::format("'{}' has a field '{}'; a document is {{\"id\"}} or {{\"text\", \"title\"}}", p,
                           key.substr(0, 64)));
      if (d[i].contains("id")) {
        ref.id = string_field(d[i]["id"], p + ".id", 128);
        expect(!ref.id.empty(), p + ".id", fmt::format("'{}.id' is empty", p));
        expect(!d[i].contains("text"), p, fmt::format("'{}' should have an 'id' or a 'text', not both", p));
      } else {
        expect(d[i].contains("text"), p + ".text", fmt::format("'{}' has neither 'id' nor 'text'", p));
        ref.text = string_field(d[i]["text"], p + ".text", limits.max_document_bytes);
        expect(!ref.text.empty(), p + ".text", fmt::format("'{}.text' is empty", p));
        if (d[i].contains("title") && !d[i]["title"].is_null()) ref.title = string_field(d[i]["title"], p + ".title", 1024);
      }
      r.documents.push_back(std::move(ref));
    }
  }
  return r;
}

DocumentUpload parse_document_upload(const std::string& body, const Limits& limits) {
  json j = parse_object(body);
  refuse_unknown_fields(j, {"text", "title", "cache_salt", "method"});
  DocumentUpload d;
  expect(j.contains("text"), "text", "'text' is required");
  d.text = string_field(j["text"], "text", limits.max_document_bytes);
  expect(!d.text.empty(), "text", "'text' is empty");
  if (j.contains("title") && !j["title"].is_null()) d.title = string_field(j["title"], "title", 1024);
  if (j.contains("cache_salt") && !j["cache_salt"].is_null())
    d.cache_salt = string_field(j["cache_salt"], "cache_salt", limits.max_salt_bytes);
  if (j.contains("method") && !j["method"].is_null()) {
    d.method = string_field(j["method"], "method", 32);
    expect(known_method(d.method), "method",
           fmt::format("'method' should be full, prefix, naive, cacheblend, epic or comb, found '{}'", d.method));
  }
  return d;
}

TokenizeRequest parse_tokenize_request(const std::string& body, const Limits& limits) {
  json j = parse_object(body);
  refuse_unknown_fields(j, {"model", "prompt", "content", "messages", "add_special_tokens", "add_special",
                            "add_generation_prompt", "return_token_strs"});
  TokenizeRequest r;
  if (j.contains("model") && !j["model"].is_null()) r.model = string_field(j["model"], "model", 512);
  int given = 0;
  for (const char* key : {"prompt", "content"})
    if (j.contains(key) && !j[key].is_null()) {
      r.prompt = string_field(j[key], key, limits.max_prompt_bytes);
      ++given;
    }
  if (j.contains("messages") && !j["messages"].is_null()) {
    r.messages = parse_messages(j["messages"], limits);
    r.chat = true;
    ++given;
  }
  expect(given == 1, "prompt", given == 0 ? "'prompt' (text) or 'messages' (a chat) is required"
                                           : "give one of 'prompt', 'content' and 'messages'");
  for (const char* key : {"add_special_tokens", "add_special"})
    if (j.contains(key) && !j[key].is_null()) r.add_special = bool_field(j[key], key);
  if (j.contains("add_generation_prompt") && !j["add_generation_prompt"].is_null()) {
    expect(r.chat, "add_generation_prompt", "'add_generation_prompt' goes with 'messages'");
    r.add_generation_prompt = bool_field(j["add_generation_prompt"], "add_generation_prompt");
  }
  if (j.contains("return_token_strs") && !j["return_token_strs"].is_null())
    r.return_token_strs = bool_field(j["return_token_strs"], "return_token_strs");
  return r;
}

DetokenizeRequest parse_detokenize_request(const std::string& body, const Limits& limits) {
  json j = parse_object(body);
  refuse_unknown_fields(j, {"model", "tokens"});
  DetokenizeRequest r;
  if (j.contains("model") && !j["model"].is_null()) r.model = string_field(j["model"], "model", 512);
  expect(j.contains("tokens"), "tokens", "'tokens' is required");
  const json& t = j["tokens"];
  expect(t.is_array(), "tokens", fmt::format("'tokens' should be a list of token ids, found {}", type_name(t)));
  expect(static_cast<int64_t>(t.size()) <= limits.max_prompt_bytes, "tokens",
         fmt::format("'tokens' has {} ids; at most {} are taken", t.size(), limits.max_prompt_bytes));
  for (size_t i = 0; i < t.size(); ++i)
    r.tokens.push_back(integer_field(t[i], fmt::format("tokens[{}]", i), 0, std::numeric_limits<int32_t>::max()));
  return r;
}

void check_request_head(const RequestHead& head, int64_t max_body_bytes, const std::vector<std::string>& allowed_origins) {
  auto shown = [](const std::string& v) { return v.substr(0, 80); };
  if (head.origin) {
    bool ok = false;
    for (const auto& o : allowed_origins) ok = ok || o == "*" || o == *head.origin;
    if (!ok)
      throw ApiError(403, fmt::format("requests from the web page of '{}' are refused: that origin is not in --allowed-origins",
                                      shown(*head.origin)), "", "origin_not_allowed", "permission_error");
  }
  const bool takes_body = head.method == "POST" || head.method == "PUT" || head.method == "PATCH";
  if (head.transfer_encoding)
    throw ApiError(411, fmt::format("a body is taken with a Content-Length only, found Transfer-Encoding: {}",
                                    shown(*head.transfer_encoding)));
  if (!head.content_length) {
    if (takes_body) throw ApiError(411, "a body needs a Content-Length");
    return;
  }
  const std::string& n = *head.content_length;
  const bool digits = !n.empty() && n.size() <= 18 && n.find_first_not_of("0123456789") == std::string::npos;
  if (!digits)
    throw ApiError(400, fmt::format("Content-Length should be a whole number of bytes, found '{}'", shown(n)));
  const int64_t bytes = std::stoll(n);
  if (bytes > max_body_bytes)
    throw ApiError(413, fmt::format("the body has {} bytes; this server takes at most {}", bytes, max_body_bytes));
  if (bytes == 0) return;
  std::string type = head.content_type ? head.content_type->substr(0, head.content_type->find(';')) : "";
  type.erase(0, type.find_first_not_of(" \t"));
  type.erase(type.find_last_not_of(" \t") + 1);
  for (auto& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (type != "application/json")
    throw ApiError(415, fmt::format("a body should be application/json, found {}",
                                    head.content_type ? "'" + shown(*head.content_type) + "'" : "no Content-Type"));
}

}  // namespace comb::serve
