#pragma once
// `comb serve`'s streams: what the engine's thread hands one request's HTTP handler (its pieces of
// text and log-probabilities, then its result: Channel), and the writer of the answer from them,
// as server-sent events or as one JSON body (reply()).
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comb/serving.hpp"

namespace httplib {
struct Response;
}

namespace comb::cli {

struct Piece {
  std::string text;
  std::vector<TokenLogprob> logprobs;
};

struct Channel {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<Piece> pieces;
  std::optional<ServeResult> result;
};

// One completion's answer as OpenAI's API writes it.
struct Answer {
  std::shared_ptr<Channel> channel;  // filled by the engine's thread
  std::string id, model;             // the answer's id, the served model's name
  int64_t created = 0;
  bool chat = true;                  // chat.completion(.chunk), else text_completion
  bool stream = false;               // server-sent events, else one JSON body
  bool usage_chunk = false;          // stream_options.include_usage
  bool logprobs = false, top = false;
  const Tokenizer* tokenizer = nullptr;  // outlives the answer (the model's)
  std::function<void()> cancel;      // the request's cancellation, when the client goes away
};

// Sets `res` to write the answer as the engine produces it. Between events a probe (an SSE
// comment, or white space before the JSON) finds a client that went away, and the request is
// cancelled.
void reply(httplib::Response& res, Answer answer);

}  // namespace comb::cli
