// Byte-level BPE tokenizer (see comb/tokenizer.hpp). No LibTorch here: this file compiles quickly.
// Compiled into libcomb (src/tokenizer.cpp), or inline in every translation unit that
// defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"
#include "comb/detail/json_number.hpp"
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <memory>
#include <mutex>
#include <queue>
#include <unordered_map>

#include "comb/detail/mapped_file.hpp"
#include "comb/detail/json.hpp"
#include "comb/error.hpp"
#include "comb/gguf.hpp"
#include "comb/tokenizer.hpp"

namespace fs = std::filesystem;

namespace comb {

namespace detail::tokenizer {  // this file's own helpers

// The split patterns of the supported pre-tokenizers.
COMB_INLINE constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
COMB_INLINE constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
COMB_INLINE constexpr const char* kDigitPattern = R"(\p{N})";

// A compiled PCRE2 pattern (UTF-8, Unicode properties, JIT when available).
class Regex {
 public:
  const std::string& pattern() const { return pattern_; }
  explicit Regex(const std::string& pattern) : pattern_(pattern) {
    int err = 0;
    PCRE2_SIZE at = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &at, nullptr);
    COMB_CHECK(code_, "tokenizer pattern '{}' does not compile at offset {}: {}", pattern, at, message(err));
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter on failure
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls on_match(begin, end) for each non-overlapping match in text[0, n). A matching error
  // (PCRE2's match limit, which a backtracking pattern from a tokenizer.json can reach) is an
  // error, not the end of the matches: that would leave the rest of the text one piece.
  template <typename F>
  void for_each_match(const char* text, size_t n, F&& on_match) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    COMB_CHECK(data != nullptr, "out of memory for the matches of the tokenizer pattern '{}'", pattern_);
    pcre2_match_data* md = data.get();
    size_t pos = 0;
    while (pos <= n) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text), n, pos, 0, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      COMB_CHECK(rc >= 0, "tokenizer pattern '{}' failed searching from byte {} of a {}-byte piece: {}", pattern_, pos,
                 n, message(rc));
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step over one character
        pos = e + 1;
        while (pos < n && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
        continue;
      }
      on_match(b, e);
      pos = e;
    }
  }

 private:
  // PCRE2's text for an error code (compiling or matching).
  static std::string message(int code) {
    std::array<PCRE2_UCHAR, 256> msg{};
    pcre2_get_error_message(code, msg.data(), msg.size());
    return reinterpret_cast<const char*>(msg.data());
  }

  std::string pattern_;
  pcre2_code* code_ = nullptr;
};

// One pre-tokenization step. Every step splits pieces further and keeps the matches ("isolated").
struct PreStep {
  std::shared_ptr<Regex> regex;
};

// GPT-2's reversible byte <-> printable-character table.
struct ByteTable {
  std::array<std::string, 256> byte_to_char;     // UTF-8 of the stand-in character
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  ByteTable() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      uint32_t cp = printable ? b : 256 + n++;
      byte_to_char[b] = encode_utf8(cp);
      cp_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
  static std::string encode_utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  }
};

COMB_INLINE const ByteTable& byte_table() {
  static const ByteTable table;
  return table;
}

// Splits UTF-8 `s` into characters (invalid bytes become one-byte pieces).
COMB_INLINE std::vector<std::string_view> utf8_chars(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + len > s.size()) len = 1;
    out.push_back(s.substr(i, len));
    i += len;
  }
  return out;
}

// The byte string a byte-level token stands for.
COMB_INLINE std::string byte_level_decode(const std::string& token) {
  const auto& table = byte_table();
  std::string out;
  for (auto ch : utf8_chars(token)) {
    uint32_t cp = 0;
    unsigned char c0 = ch[0];
    if (ch.size() == 1) cp = c0;
    else if (ch.size() == 2) cp = ((c0 & 0x1F) << 6) | (ch[1] & 0x3F);
    else if (ch.size() == 3) cp = ((c0 & 0x0F) << 12) | ((ch[1] & 0x3F) << 6) | (ch[2] & 0x3F);
    auto it = ch.size() <= 3 ? table.cp_to_byte.find(cp) : table.cp_to_byte.end();
    if (it != table.cp_to_byte.end()) out += static_cast<char>(it->second);
    else out.append(ch);
  }
  return out;
}

COMB_INLINE uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }

}  // namespace detail::tokenizer

// ================================================================================================
// Tokenizer
// ================================================================================================

struct Tokenizer::Impl {
  std::vector<std::string> tokens;  // as the vocabulary writes them (byte-level characters)
  std::vector<std::string> bytes;   // what each token decodes to
  std::vector<bool> special;
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a, b) -> (rank, merged)
  std::vector<std::pair<int32_t, int32_t>> merge_list;               // in rank order
  std::vector<int32_t> added;       // added tokens, matched in raw text, longest first
  std::vector<detail::tokenizer::PreStep> steps;
  bool ignore_merges = false;
  std::optional<int32_t> bos, eos;
  bool add_bos = false;
  std::string chat_template;
  std::string where;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  void finish() {
    bytes.resize(tokens.size());
    special.resize(tokens.size(), false);
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (bytes[i].empty()) bytes[i] = detail::tokenizer::byte_level_decode(tokens[i]);
      vocab.emplace(tokens[i], static_cast<int32_t>(i));
    }
    std::sort(added.begin(), added.end(),
              [&](int32_t a, int32_t b) { return tokens[a].size() > tokens[b].size(); });
  }

  void add_merge(const std::string& a, const std::string& b, int32_t rank) {
    auto ia = vocab.find(a), ib = vocab.find(b), im = vocab.find(a + b);
    COMB_CHECK(ia != vocab.end() && ib != vocab.end() && im != vocab.end(),
               "{}: merge {} of '{}' + '{}' names a token the vocabulary lacks", where, rank, a, b);
    merges.emplace(detail::tokenizer::pair_key(ia->second, ib->second), std::make_pair(rank, im->second));
    merge_list.emplace_back(ia->second, ib->second);
  }

  // Applies the merges to one piece's symbols: the adjacent pair of lowest rank first, the leftmost
  // of equal ranks first, until no pair has a merge. Candidate pairs wait in a heap ordered by
  // (rank, position) over a linked list of the symbols, and a candidate whose symbols have changed
  // since it was pushed is skipped, so a piece of n symbols takes O(n log n). (Rescanning every pair
  // after each merge took O(n^2): minutes for a run of 100,000 letters.)
  void merge_all(std::vector<int32_t>& symbols) const {
    COMB_CHECK(symbols.size() < static_cast<size_t>(INT32_MAX), "{}: a piece of {} characters is too long to tokenize",
               where, symbols.size());
    const int32_t n = static_cast<int32_t>(symbols.size());
    if (n < 2) return;
    struct Candidate {
      int32_t rank, at, left, right, merged;  // the pair (left, right) at symbol `at` and what it becomes
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : at > o.at; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
    std::vector<int32_t> prev(n), next(n);  // the list of live symbols; -1 at its ends
    for (int32_t i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    auto push = [&](int32_t i) {
      const int32_t j = next[i];
      if (j < 0) return;
      auto it = merges.find(detail::tokenizer::pair_key(symbols[i], symbols[j]));
      if (it != merges.end()) heap.push({it->second.first, i, symbols[i], symbols[j], it->second.second});
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      const int32_t j = next[c.at];  // a merged-away symbol holds -1, which no candidate names
      if (symbols[c.at] != c.left || j < 0 || symbols[j] != c.right) continue;
      symbols[c.at] = c.merged;
      symbols[j] = -1;
      next[c.at] = next[j];
      if (next[j] >= 0) prev[next[j]] = c.at;
      if (prev[c.at] >= 0) push(prev[c.at]);
      push(c.at);
    }
    symbols.erase(std::remove(symbols.begin(), symbols.end(), -1), symbols.end());
  }

  // BPE over one pre-tokenized piece (already in byte-level characters).
  void bpe(const std::string& word, std::vector<int32_t>& out) const {
    if (ignore_merges) {
      auto it = vocab.find(word);
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    {
      std::lock_guard<std::mutex> lock(cache_mutex);
      auto it = cache.find(word);
      if (it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> symbols;
    for (auto ch : detail::tokenizer::utf8_chars(word)) {
      auto it = vocab.find(std::string(ch));
      COMB_CHECK(it != vocab.end(), "{}: the vocabulary has no token for character '{}'", where, std::string(ch));
      symbols.push_back(it->second);
    }
    merge_all(symbols);
    out.insert(out.end(), symbols.begin(), symbols.end());
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() > 200000) cache.clear();
    cache.emplace(word, std::move(symbols));
  }

  // Pre-tokenizes and encodes text that holds no added token.
  void encode_plain(std::string_view text, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    std::vector<std::pair<size_t, size_t>> pieces{{0, text.size()}};
    for (const auto& step : steps) {
      std::vector<std::pair<size_t, size_t>> next;
      for (const auto& piece : pieces) {
        const size_t b = piece.first, e = piece.second;  // lambdas may not capture bindings (C++17)
        size_t last = b;
        step.regex->for_each_match(text.data() + b, e - b, [&](size_t mb, size_t me) {
          if (b + mb > last) next.emplace_back(last, b + mb);
          next.emplace_back(b + mb, b + me);
          last = b + me;
        });
        if (last < e) next.emplace_back(last, e);
      }
      pieces = std::move(next);
    }
    const auto& table = detail::tokenizer::byte_table();
    std::string word;
    for (auto [b, e] : pieces) {
      word.clear();
      for (size_t i = b; i < e; ++i) word += table.byte_to_char[static_cast<unsigned char>(text[i])];
      bpe(word, out);
    }
  }
};

COMB_INLINE Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
COMB_INLINE Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
COMB_INLINE Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
COMB_INLINE Tokenizer::~Tokenizer() = default;

namespace detail::tokenizer {  // this file's own helpers
COMB_INLINE std::vector<PreStep> gguf_pre_steps(const std::string& pre, const std::string& where) {
  auto gpt2 = std::make_shared<Regex>(kGpt2Pattern);
  if (pre == "gpt2" || pre == "default" || pre == "mpt" || pre == "olmo") return {{gpt2}};
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "codeshell")
    return {{std::make_shared<Regex>(kDigitPattern)}, {gpt2}};
  if (pre == "llama3" || pre == "llama-v3" || pre == "llama-bpe" || pre == "smaug-bpe" || pre == "dbrx")
    return {{std::make_shared<Regex>(kLlama3Pattern)}};
  COMB_FAIL("{}: pre-tokenizer '{}' is not supported (supported: gpt2, smollm, starcoder, llama-bpe, llama3)", where,
            pre);
}
}  // namespace detail::tokenizer

COMB_INLINE Tokenizer Tokenizer::from_gguf(const GgufFile& gguf) {
  auto impl = std::make_unique<Impl>();
  impl->where = gguf.where();
  std::string model = gguf.get_string("tokenizer.ggml.model");
  COMB_CHECK(model == "gpt2", "'{}': tokenizer model '{}' is not supported (expected byte-level BPE, 'gpt2')",
             gguf.where(), model);
  // Typed reads that name the key, rather than JSON type errors that name nothing.
  auto list_of = [&](const char* key, bool (nlohmann::json::*is)() const noexcept, const char* what) -> const nlohmann::json& {
    const auto& v = gguf.get(key);
    bool ok = v.is_array();
    for (size_t i = 0; ok && i < v.size(); ++i) ok = (v[i].*is)();
    COMB_CHECK(ok, "'{}': GGUF metadata '{}' should be a list of {}", gguf.where(), key, what);
    return v;
  };
  for (const auto& t : list_of("tokenizer.ggml.tokens", &nlohmann::json::is_string, "strings"))
    impl->tokens.push_back(t.get<std::string>());
  impl->special.assign(impl->tokens.size(), false);
  if (gguf.has("tokenizer.ggml.token_type")) {
    const auto& types = list_of("tokenizer.ggml.token_type", &nlohmann::json::is_number_integer, "integers");
    COMB_CHECK(types.size() == impl->tokens.size(), "'{}': {} token types for {} tokens", gguf.where(), types.size(),
               impl->tokens.size());
    for (size_t i = 0; i < types.size(); ++i) {
      int type = types[i].get<int>();
      if (type == 3 || type == 4) {  // control, user-defined: matched whole in raw text
        impl->added.push_back(static_cast<int32_t>(i));
        impl->bytes.resize(impl->tokens.size());
        impl->bytes[i] = impl->tokens[i];
        impl->special[i] = type == 3;
      }
    }
  }
  impl->steps = detail::tokenizer::gguf_pre_steps(
      gguf.has("tokenizer.ggml.pre") ? gguf.get_string("tokenizer.ggml.pre") : "default", gguf.where());
  impl->finish();
  if (gguf.has("tokenizer.ggml.merges")) {
    int32_t rank = 0;
    for (const auto& m : list_of("tokenizer.ggml.merges", &nlohmann::json::is_string, "strings")) {
      std::string s = m.get<std::string>();
      size_t sp = s.find(' ', 1);
      COMB_CHECK(sp != std::string::npos, "'{}': merge {} '{}' has no space", gguf.where(), rank, s);
      impl->add_merge(s.substr(0, sp), s.substr(sp + 1), rank++);
    }
  }
  auto id = [&](const char* key) -> std::optional<int32_t> {
    if (!gguf.has(key)) return std::nullopt;
    int64_t v = gguf.get_int(key);
    COMB_CHECK(v >= 0 && v < static_cast<int64_t>(impl->tokens.size()), "'{}': {} = {} is outside the vocabulary",
               gguf.where(), key, v);
    return static_cast<int32_t>(v);
  };
  impl->bos = id("tokenizer.ggml.bos_token_id");
  impl->eos = id("tokenizer.ggml.eos_token_id");
  if (gguf.has("tokenizer.ggml.add_bos_token")) {
    const auto& v = gguf.get("tokenizer.ggml.add_bos_token");
    COMB_CHECK(v.is_boolean(), "'{}': GGUF metadata 'tokenizer.ggml.add_bos_token' should be true or false, found {}",
               gguf.where(), v.type_name());
    impl->add_bos = v.get<bool>();
  }
  if (gguf.has("tokenizer.chat_template")) impl->chat_template = gguf.get_string("tokenizer.chat_template");
  return Tokenizer(std::move(impl));
}

namespace detail::tokenizer {  // this file's own helpers
COMB_INLINE void parse_pre_tokenizer(const nlohmann::json& p, std::vector<PreStep>& steps, const std::string& where) {
  if (p.is_null()) return;
  std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const auto& s : p.at("pretokenizers")) parse_pre_tokenizer(s, steps, where);
  } else if (type == "ByteLevel") {
    COMB_CHECK(!p.value("add_prefix_space", false), "{}: ByteLevel add_prefix_space is not supported", where);
    if (p.value("use_regex", true)) steps.push_back({std::make_shared<Regex>(kGpt2Pattern)});
  } else if (type == "Digits") {
    COMB_CHECK(p.value("individual_digits", false), "{}: Digits pre-tokenizer without individual_digits is not supported",
               where);
    steps.push_back({std::make_shared<Regex>(kDigitPattern)});
  } else if (type == "Split") {
    COMB_CHECK(p.value("behavior", "") == "Isolated" && !p.value("invert", false),
               "{}: Split pre-tokenizer with behavior '{}' is not supported (expected Isolated)", where,
               p.value("behavior", ""));
    const auto& pat = p.at("pattern");
    std::string regex = pat.contains("Regex") ? pat["Regex"].get<std::string>() : std::string();
    if (regex.empty()) {  // a literal string: escape it
      for (char c : pat.at("String").get<std::string>()) {
        if (std::string("\\^$.|?*+()[]{}").find(c) != std::string::npos) regex += '\\';
        regex += c;
      }
    }
    steps.push_back({std::make_shared<Regex>(regex)});
  } else {
    COMB_FAIL("{}: pre-tokenizer '{}' is not supported (supported: Sequence, ByteLevel, Digits, Split)", where, type);
  }
}
}  // namespace detail::tokenizer

COMB_INLINE Tokenizer Tokenizer::from_hf_json(const nlohmann::json& j, const std::string& where) {
  auto impl = std::make_unique<Impl>();
  impl->where = where;
  COMB_CHECK(j.contains("model") && j["model"].value("type", "BPE") == "BPE",
             "{}: tokenizer model '{}' is not supported (expected BPE)", where,
             j.contains("model") ? j["model"].value("type", "?") : "missing");
  COMB_CHECK(!j.contains("normalizer") || j["normalizer"].is_null(), "{}: normalizer '{}' is not supported", where,
             j["normalizer"].value("type", "?"));
  const auto& model = j["model"];
  COMB_CHECK(!model.value("byte_fallback", false), "{}: byte_fallback BPE is not supported", where);
  const auto& vocab = model.at("vocab");
  impl->tokens.resize(vocab.size());
  for (auto& [tok, id] : vocab.items()) {
    int64_t i = detail::json_whole(id, where + ": the id of token '" + tok + "'");
    COMB_CHECK(i >= 0 && i < static_cast<int64_t>(vocab.size()), "{}: token '{}' has id {} outside [0, {})", where,
               tok, i, vocab.size());
    impl->tokens[i] = tok;
  }
  if (j.contains("added_tokens")) {
    // Added tokens extend the vocabulary: an id past the vocabulary and the added tokens together
    // (or below 0) would be a write out of bounds or a vast resize.
    const int64_t limit = static_cast<int64_t>(vocab.size() + j["added_tokens"].size());
    for (const auto& t : j["added_tokens"]) {
      int64_t i = detail::json_whole(t.at("id"), where + ": an added token's id");
      COMB_CHECK(i >= 0 && i < limit, "{}: added token '{}' has id {} outside [0, {}) (the vocabulary and the added tokens)",
                 where, t.value("content", "?"), i, limit);
      if (i >= static_cast<int64_t>(impl->tokens.size())) impl->tokens.resize(i + 1);
      impl->tokens[i] = t.at("content").get<std::string>();
      impl->bytes.resize(impl->tokens.size());
      impl->bytes[i] = impl->tokens[i];
      impl->special.resize(impl->tokens.size(), false);
      impl->special[i] = t.value("special", false);
      impl->added.push_back(static_cast<int32_t>(i));
    }
  }
  impl->ignore_merges = model.value("ignore_merges", false);
  detail::tokenizer::parse_pre_tokenizer(j.value("pre_tokenizer", nlohmann::json()), impl->steps, where);
  impl->finish();
  int32_t rank = 0;
  for (const auto& m : model.at("merges")) {
    if (m.is_string()) {
      std::string s = m.get<std::string>();
      size_t sp = s.find(' ', 1);
      COMB_CHECK(sp != std::string::npos, "{}: merge {} '{}' has no space", where, rank, s);
      impl->add_merge(s.substr(0, sp), s.substr(sp + 1), rank++);
    } else {
      impl->add_merge(m.at(0).get<std::string>(), m.at(1).get<std::string>(), rank++);
    }
  }
  return Tokenizer(std::move(impl));
}

COMB_INLINE Tokenizer Tokenizer::from_hf_file(const std::string& path) {
  const nlohmann::json j = detail::parse_json(detail::read_text_file(path, detail::kMaxJsonFileBytes), fmt::format("'{}'", path));
  // A field of the wrong type or a missing one throws nlohmann's error, which names neither the
  // file nor the field: the file is named here.
  auto named = [](const std::string& file, auto&& read) {
    try {
      return read();
    } catch (const nlohmann::json::exception& ex) {
      COMB_FAIL("'{}': a field is missing or of the wrong type: {}", file, ex.what());
    }
  };
  Tokenizer tok = named(path, [&] { return from_hf_json(j, path); });
  // tokenizer_config.json beside it names BOS/EOS and carries the chat template.
  fs::path config = fs::path(path).parent_path() / "tokenizer_config.json";
  auto token_text = [](const nlohmann::json& v) {
    return v.is_string() ? v.get<std::string>() : v.is_object() ? v.value("content", "") : std::string();
  };
  if (fs::exists(config)) {
    nlohmann::json c = detail::parse_json(detail::read_text_file(config.string(), detail::kMaxJsonFileBytes),
                                          fmt::format("'{}'", config.string()), /*invalid_ok=*/true);
    COMB_CHECK(!c.is_discarded() && c.is_object(), "'{}': not a JSON object", config.string());
    named(config.string(), [&] {
      if (c.contains("bos_token")) tok.impl_->bos = tok.find_token(token_text(c["bos_token"]));
      if (c.contains("eos_token")) tok.impl_->eos = tok.find_token(token_text(c["eos_token"]));
      tok.impl_->add_bos = c.value("add_bos_token", false);
      if (c.contains("chat_template") && c["chat_template"].is_string())
        tok.impl_->chat_template = c["chat_template"].get<std::string>();
    });
  }
  fs::path jinja = fs::path(path).parent_path() / "chat_template.jinja";
  if (fs::exists(jinja)) tok.impl_->chat_template = detail::read_text_file(jinja.string());
  return tok;
}

COMB_INLINE std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<int32_t> out;
  const auto& added = impl_->added;
  if (!parse_special || added.empty()) {
    impl_->encode_plain(text, out);
    return out;
  }
  size_t start = 0, i = 0;
  while (i < text.size()) {
    int32_t hit = -1;
    for (int32_t id : added) {  // longest first
      const std::string& t = impl_->tokens[id];
      if (!t.empty() && t[0] == text[i] && text.compare(i, t.size(), t) == 0) {
        hit = id;
        break;
      }
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    impl_->encode_plain(text.substr(start, i - start), out);
    out.push_back(hit);
    i += impl_->tokens[hit].size();
    start = i;
  }
  impl_->encode_plain(text.substr(start), out);
  return out;
}

COMB_INLINE std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    COMB_CHECK(id >= 0 && id < n_vocab(), "token id {} is outside the vocabulary [0, {})", id, n_vocab());
    if (skip_special && impl_->special[id]) continue;
    out += impl_->bytes[id];
  }
  return out;
}

COMB_INLINE std::string Tokenizer::token_bytes(int32_t id) const {
  COMB_CHECK(id >= 0 && id < n_vocab(), "token id {} is outside the vocabulary [0, {})", id, n_vocab());
  return impl_->bytes[id];
}

COMB_INLINE int64_t Tokenizer::n_vocab() const { return static_cast<int64_t>(impl_->tokens.size()); }
COMB_INLINE std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
COMB_INLINE std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
COMB_INLINE bool Tokenizer::add_bos() const { return impl_->add_bos; }
COMB_INLINE bool Tokenizer::is_special(int32_t id) const { return id >= 0 && id < n_vocab() && impl_->special[id]; }
COMB_INLINE const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }

COMB_INLINE void Tokenizer::save_hf(const std::string& dir) const {
  const Impl& t = *impl_;
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (size_t i = 0; i < t.tokens.size(); ++i) vocab[t.tokens[i]] = i;
  nlohmann::json merges = nlohmann::json::array();
  for (auto [a, b] : t.merge_list) merges.push_back(t.tokens[a] + " " + t.tokens[b]);
  nlohmann::json added = nlohmann::json::array();
  std::vector<int32_t> ids = t.added;
  std::sort(ids.begin(), ids.end());
  for (int32_t id : ids)
    added.push_back({{"id", id}, {"content", t.tokens[id]}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", bool(t.special[id])}});
  nlohmann::json steps = nlohmann::json::array();
  for (const auto& step : t.steps)
    steps.push_back({{"type", "Split"}, {"pattern", {{"Regex", step.regex->pattern()}}}, {"behavior", "Isolated"},
                     {"invert", false}});
  steps.push_back({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}});
  nlohmann::ordered_json j = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", steps}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}},
      {"model", {{"type", "BPE"}, {"ignore_merges", t.ignore_merges}, {"vocab", vocab}, {"merges", merges}}}};
  detail::write_file_atomic(dir + "/tokenizer.json", j.dump());
  nlohmann::json config = {{"add_bos_token", t.add_bos}};
  if (t.bos) config["bos_token"] = t.tokens[*t.bos];
  if (t.eos) config["eos_token"] = t.tokens[*t.eos];
  if (!t.chat_template.empty()) config["chat_template"] = t.chat_template;
  detail::write_file_atomic(dir + "/tokenizer_config.json", config.dump(2));
}

COMB_INLINE std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  auto it = impl_->vocab.find(std::string(text));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

COMB_INLINE std::string StreamDecoder::push(int32_t id) {
  pending_ += tokenizer_->token_bytes(id);
  // Emit everything up to the last complete UTF-8 character.
  size_t n = pending_.size(), cut = n;
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    unsigned char c = pending_[n - back];
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    cut = len > back ? n - back : n;
    break;
  }
  std::string out = pending_.substr(0, cut);
  pending_.erase(0, cut);
  return out;
}

COMB_INLINE std::string StreamDecoder::flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace comb
