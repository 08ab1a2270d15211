#pragma once
// The HTTP API of `comb serve` without the server: OpenAI-shaped request bodies parsed and checked
// (parse_completion_request), and the JSON of errors. Nothing here touches the model, so that the
// parser can be fuzzed alone (tests/fuzz).
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "comb/chat_template.hpp"  // ChatMessage (no LibTorch)

namespace comb::serve {

// A request the server refuses: the HTTP status and OpenAI's error fields.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "",
           std::string type = "")
      : std::runtime_error(message), status(status), param(std::move(param)), code(std::move(code)),
        type(type.empty() ? default_type(status) : std::move(type)) {}
  int status;
  std::string param, code, type;
  static std::string default_type(int status);
};

// {"error": {"message", "type", "param", "code"}}.
std::string error_body(const ApiError& e);

struct DocumentRef {
  std::string id;           // a document uploaded with POST /v1/documents, or
  std::string title, text;  // one given in full
};

struct Limits {
  int64_t max_documents = 32;
  int64_t max_document_bytes = 64 * 1024;
  int64_t max_request_document_tokens = 16384;  // all of a request's documents, cached or not (413 past it)
  int64_t max_prompt_bytes = 1024 * 1024;
  int64_t max_messages = 256;
  int64_t max_stop = 4;
  int64_t max_salt_bytes = 256;
};

struct CompletionRequest {
  bool chat = true;                    // /v1/chat/completions, else /v1/completions
  std::string model;
  std::vector<ChatMessage> messages;   // chat
  std::string prompt;                  // completions: text, or
  std::vector<int64_t> prompt_ids;     // token ids (checked against the vocabulary later)
  bool prompt_is_ids = false;
  std::vector<DocumentRef> documents;
  std::optional<int64_t> max_tokens;
  double temperature = 1.0;            // OpenAI's default
  double top_p = 1.0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;          // stream_options.include_usage
  std::string method;                  // "" : the server's default
  std::string cache_salt;
  bool ignore_eos = false;             // go on past end-of-sequence (benchmarks; as vLLM's)
  bool logprobs = false;               // each token's log-probability (chat: logprobs; completions: logprobs >= 0)
  int64_t top_logprobs = 0;            // alternatives per token (chat: top_logprobs; completions: logprobs)
};
constexpr int64_t kMaxTopLogprobs = 20;

// Parses and checks a request body; throws ApiError (400, naming the field) on anything malformed:
// not JSON, not an object, a field of the wrong type or out of range, more documents or stop
// strings than `limits`, options comb does not implement (n > 1, tools).
CompletionRequest parse_completion_request(const std::string& body, bool chat, const Limits& limits);

// A document upload: {"text", "title"?, "cache_salt"?, "method"?}.
struct DocumentUpload {
  std::string title, text, cache_salt, method;
};
DocumentUpload parse_document_upload(const std::string& body, const Limits& limits);

// POST /tokenize: {"prompt"} (or llama.cpp's "content") or {"messages", "add_generation_prompt"?},
// "add_special_tokens"? (or "add_special"), "return_token_strs"?, "model"?.
struct TokenizeRequest {
  std::string model;
  std::string prompt;
  std::vector<ChatMessage> messages;
  bool chat = false;                   // messages, rendered with the chat template
  bool add_special = true;             // the tokenizer's BOS, where it adds one (prompt)
  bool add_generation_prompt = true;   // messages: the assistant's turn opened
  bool return_token_strs = false;
};
TokenizeRequest parse_tokenize_request(const std::string& body, const Limits& limits);

// POST /detokenize: {"tokens": [ids], "model"?} (ids checked against the vocabulary later).
struct DetokenizeRequest {
  std::string model;
  std::vector<int64_t> tokens;
};
DetokenizeRequest parse_detokenize_request(const std::string& body, const Limits& limits);

// A request's line and headers, checked before its body is read (check_request_head), so that a
// body the server would refuse is never read nor waited for.
struct RequestHead {
  std::string method;
  std::optional<std::string> content_length, content_type, transfer_encoding, origin;
};
// Throws ApiError: 403 for an Origin not in `allowed_origins` (a web page's request; "*" allows
// any); for a body: 411 without a Content-Length or with a Transfer-Encoding (chunked bodies are not
// taken), 400 for a Content-Length that is not a whole number, 413 past `max_body_bytes`, 415 for a
// Content-Type other than application/json (a form a web page can post without asking).
void check_request_head(const RequestHead& head, int64_t max_body_bytes, const std::vector<std::string>& allowed_origins);

// The caching methods a request may name.
bool known_method(const std::string& name);

}  // namespace comb::serve
