#pragma once
// `comb serve`'s streams: what the engine's thread hands one request's HTTP handler (its pieces of
// text and log-probabilities, then its result), which the handler writes as server-sent events or
// as one JSON body.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comb/serving.hpp"

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

}  // namespace comb::cli
