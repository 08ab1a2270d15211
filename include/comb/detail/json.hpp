#pragma once
// The one way comb reads JSON text (data items, config.json, tokenizer files, safetensors headers,
// plug-in metadata, teacher files, the server's request bodies): parse_json refuses nesting deeper
// than a bound before building it, so no input can exhaust the stack of a reader or of a later
// recursive walk over the value (dump, comparison, destruction).
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>

#include "comb/error.hpp"

namespace comb::detail {

// Deepest nesting any reader accepts: comb's own files nest at most 4 levels, tokenizer.json 5;
// the server's bodies about 5.
inline constexpr int kMaxJsonDepth = 64;
// Largest JSON file read whole (config.json, tokenizer.json of a 250k-word vocabulary: about 20 MB).
inline constexpr int64_t kMaxJsonFileBytes = int64_t(256) << 20;

// Thrown for nesting beyond the bound: a comb::Error whose message names `where`, the bound, and
// the top-level field it was found in.
class JsonDepthError : public Error {
 public:
  using Error::Error;
};

// Parses `text`; `where` names the input in messages ("'items.jsonl' line 3"). Invalid JSON throws
// comb::Error ("<where>: not valid JSON: ...") or, with `invalid_ok`, returns a discarded value
// (is_discarded()) for the caller to report; nesting deeper than `max_depth` always throws
// JsonDepthError.
inline nlohmann::json parse_json(std::string_view text, const std::string& where, bool invalid_ok = false,
                                 int max_depth = kMaxJsonDepth) {
  using json = nlohmann::json;
  std::string field;  // the top-level key being read, for the message
  auto guard = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) field = parsed.get<std::string>();
    // `depth` is the number of containers around the one that opens.
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= max_depth)
      throw JsonDepthError(field.empty() ? fmt::format("{}: JSON nested deeper than {} levels", where, max_depth)
                                         : fmt::format("{}: JSON nested deeper than {} levels, in field '{}'", where,
                                                       max_depth, field.substr(0, 64)));
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), guard, /*allow_exceptions=*/!invalid_ok);
  } catch (const json::exception& e) {  // syntax, or a number beyond a double's range
    throw Error(fmt::format("{}: not valid JSON: {}", where, e.what()));
  }
}

}  // namespace comb::detail
