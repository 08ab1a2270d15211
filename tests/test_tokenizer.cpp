// Tokenizer parity with Hugging Face `tokenizers`, round trips, streaming, and chat templates.
#include <catch2/catch.hpp>
#include <filesystem>

#include "helpers.hpp"

using namespace comb;
using namespace comb::test;
namespace fs = std::filesystem;

namespace {
void check_parity(const Tokenizer& tok, const std::string& cases_path) {
  auto cases = read_jsonl(cases_path);
  REQUIRE(cases.size() >= 2000);
  size_t mismatched = 0, not_round_trip = 0;
  for (const auto& c : cases) {
    std::string text = c["text"].get<std::string>();
    auto want = c["ids"].get<std::vector<int32_t>>();
    auto got = tok.encode(text);
    if (got != want) {
      if (++mismatched <= 5) UNSCOPED_INFO("ids differ for " << nlohmann::json(text).dump());
    }
    if (tok.decode(got) != text) {
      if (++not_round_trip <= 5) UNSCOPED_INFO("decode(encode(s)) != s for " << nlohmann::json(text).dump());
    }
  }
  INFO(cases.size() << " strings from " << cases_path);
  CHECK(mismatched == 0);
  CHECK(not_round_trip == 0);
}
}  // namespace

TEST_CASE("SmolLM2 tokenizer from GGUF matches Hugging Face tokenizers", "[tokenizer]") {
  GgufFile gguf(model_path());
  Tokenizer tok = Tokenizer::from_gguf(gguf);
  CHECK(tok.n_vocab() == 49152);
  check_parity(tok, oracle_dir() + "/smollm2.jsonl");
}

TEST_CASE("tokenizer.json with Llama-3's split regex matches Hugging Face tokenizers", "[tokenizer]") {
  Tokenizer tok = Tokenizer::from_hf_file(oracle_dir() + "/llama3/tokenizer.json");
  check_parity(tok, oracle_dir() + "/llama3/cases.jsonl");
}

TEST_CASE("special tokens are matched in text only when asked", "[tokenizer]") {
  GgufFile gguf(model_path());
  Tokenizer tok = Tokenizer::from_gguf(gguf);
  auto im_end = tok.find_token("<|im_end|>");
  REQUIRE(im_end);
  CHECK(tok.is_special(*im_end));
  CHECK(tok.encode("a<|im_end|>b") == std::vector<int32_t>{tok.encode("a")[0], *im_end, tok.encode("b")[0]});
  auto plain = tok.encode("<|im_end|>", /*parse_special=*/false);
  CHECK(plain.size() > 1);
  CHECK(tok.decode(plain) == "<|im_end|>");
  CHECK(tok.decode(tok.encode("x<|im_end|>"), /*skip_special=*/true) == "x");
  CHECK_THROWS_AS(tok.decode({-1}), Error);
  CHECK_THROWS_AS(tok.decode({49152}), Error);
}

TEST_CASE("streaming decode yields whole UTF-8 characters", "[tokenizer]") {
  GgufFile gguf(model_path());
  Tokenizer tok = Tokenizer::from_gguf(gguf);
  std::string text = "naïve 日本語 👨‍👩‍👧 ok";
  auto ids = tok.encode(text);
  StreamDecoder stream(tok);
  std::string joined;
  for (int32_t id : ids) {
    std::string piece = stream.push(id);
    // Each piece is valid UTF-8 on its own: it never ends inside a character.
    if (!piece.empty()) {
      unsigned char last_lead = 0;
      size_t i = piece.size();
      while (i > 0 && (static_cast<unsigned char>(piece[i - 1]) & 0xC0) == 0x80) --i;
      REQUIRE(i > 0);
      last_lead = piece[i - 1];
      size_t len = last_lead < 0x80 ? 1 : (last_lead >> 5) == 6 ? 2 : (last_lead >> 4) == 14 ? 3 : 4;
      CHECK(piece.size() - (i - 1) == len);
    }
    joined += piece;
  }
  joined += stream.flush();
  CHECK(joined == text);
}

TEST_CASE("chat template renders as the checkpoint's Jinja template does", "[tokenizer][chat]") {
  GgufFile gguf(model_path());
  ChatTemplate tmpl = ChatTemplate::from_source(gguf.get_string("tokenizer.chat_template"));
  CHECK(tmpl.family() == ChatTemplate::Family::chatml);
  auto cases = read_jsonl(oracle_dir() + "/chat_cases.jsonl");
  REQUIRE(cases.size() >= 4);
  for (const auto& c : cases) {
    std::vector<ChatMessage> messages;
    for (const auto& m : c["messages"]) messages.push_back({m["role"], m["content"]});
    CHECK(tmpl.apply(messages, c["add_generation_prompt"].get<bool>()) == c["text"].get<std::string>());
  }
}

TEST_CASE("Llama-3 chat format and unknown templates", "[tokenizer][chat]") {
  ChatTemplate llama3 = ChatTemplate::from_source("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}");
  CHECK(llama3.apply({{"system", "Be brief."}, {"user", " Hi "}}) ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK(llama3.end_of_turn() == "<|eot_id|>");
  CHECK_THROWS_WITH(ChatTemplate::from_source("{{ messages }}"), Catch::Contains("not recognised"));
}

TEST_CASE("bad tokenizer files name the file; a model without a chat template says so", "[tokenizer][errors]") {
  const std::string dir = temp_dir("tok-bad");
  auto error_of = [&](const std::string& tokenizer, const std::string& config) {
    write_bytes(dir + "/tokenizer.json", tokenizer);
    if (config.empty()) fs::remove(dir + "/tokenizer_config.json");
    else write_bytes(dir + "/tokenizer_config.json", config);
    try {
      Tokenizer::from_hf_file(dir + "/tokenizer.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string vocab = R"({"model":{"type":"BPE","vocab":{"a":0,"b":1},"merges":[]})";
  CHECK(error_of(vocab + "}", "").empty());  // the minimal file is valid
  // An added token's id below 0 (was written at tokens[-1]) or far past the vocabulary.
  CHECK_THAT(error_of(vocab + R"(,"added_tokens":[{"id":-1,"content":"<x>"}]})", ""),
             Catch::Contains("'<x>' has id -1 outside [0, 3)") && Catch::Contains("tokenizer.json"));
  CHECK_THAT(error_of(vocab + R"(,"added_tokens":[{"id":4000000000,"content":"<x>"}]})", ""),
             Catch::Contains("id 4000000000 outside"));
  CHECK(error_of(vocab + R"(,"added_tokens":[{"id":2,"content":"<x>"}]})", "").empty());
  // Fields of the wrong type: the file is named, not only nlohmann's type error.
  CHECK_THAT(error_of(R"({"model":{"type":"BPE","vocab":{"a":"zero"},"merges":[]}})", ""),
             Catch::Contains("tokenizer.json: the id of token 'a': expected a whole number, found \"zero\""));
  // An id too large for any integer, written as a float (found by the tokenizer_json fuzz target:
  // its conversion was undefined behaviour).
  CHECK_THAT(error_of(R"({"model":{"type":"BPE","vocab":{"a":7.7e21},"merges":[]}})", ""),
             Catch::Contains("the id of token 'a': expected a whole number, found 7.7e+21"));
  CHECK_THAT(error_of(vocab + R"(,"added_tokens":[{"id":1.5,"content":"<x>"}]})", ""),
             Catch::Contains("an added token's id: expected a whole number, found 1.5"));
  CHECK_THAT(error_of(R"({"model":{"type":"BPE","merges":[]}})", ""),
             Catch::Contains("tokenizer.json': a field is missing or of the wrong type"));
  CHECK_THAT(error_of(vocab + "}", R"({"add_bos_token":null})"),
             Catch::Contains("tokenizer_config.json': a field is missing or of the wrong type"));
  CHECK_THAT(error_of(vocab + "}", "[1]"), Catch::Contains("tokenizer_config.json': not a JSON object"));

  Model tiny = Model::load(oracle_dir() + "/tiny-llama");  // a tokenizer.json and no template
  CHECK_THROWS_WITH(tiny.chat_template(), Catch::Contains("ships no chat template"));
}

TEST_CASE("a split pattern that exhausts the regex engine is an error, not one piece", "[tokenizer][errors]") {
  const std::string dir = temp_dir("tok-split");
  // (a+)+[^a] tries every way of cutting a run of a's before failing: 2^40 for the run below,
  // past PCRE2's match limit (10 million), while the same pattern splits ordinary text.
  write_bytes(dir + "/tokenizer.json",
              R"({"model":{"type":"BPE","vocab":{"a":0,"b":1},"merges":[]},)"
              R"("pre_tokenizer":{"type":"Split","pattern":{"Regex":"(a+)+[^a]"},"behavior":"Isolated"}})");
  Tokenizer tok = Tokenizer::from_hf_file(dir + "/tokenizer.json");
  CHECK(tok.encode("aab") == std::vector<int32_t>{0, 0, 1});
  CHECK_THROWS_WITH(tok.encode(std::string(40, 'a')),
                    Catch::Contains("tokenizer pattern '(a+)+[^a]' failed searching from byte 0 of a 40-byte piece") &&
                        Catch::Contains("limit"));
  // A pattern that does not compile is refused when the file is read, with PCRE2's reason.
  write_bytes(dir + "/tokenizer.json",
              R"({"model":{"type":"BPE","vocab":{"a":0,"b":1},"merges":[]},)"
              R"("pre_tokenizer":{"type":"Split","pattern":{"Regex":"(a"},"behavior":"Isolated"}})");
  CHECK_THROWS_WITH(Tokenizer::from_hf_file(dir + "/tokenizer.json"),
                    Catch::Contains("tokenizer pattern '(a' does not compile at offset 2: missing closing parenthesis"));
}

TEST_CASE("GGUF tokenizer metadata of the wrong type names its key", "[tokenizer][errors]") {
  const std::string dir = temp_dir("tok-gguf");
  auto error_of = [&](const GgufWriter& w) {
    write_bytes(dir + "/t.gguf", w.bytes());
    GgufFile gguf(dir + "/t.gguf");
    try {
      Tokenizer::from_gguf(gguf);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto base = [] {
    GgufWriter w;
    w.kv_str("tokenizer.ggml.model", "gpt2");
    return w;
  };
  GgufWriter good = base();
  good.kv_strs("tokenizer.ggml.tokens", {"a", "b", "ab"});
  good.kv_strs("tokenizer.ggml.merges", {"a b"});
  CHECK(error_of(good).empty());
  GgufWriter tokens = base();
  tokens.kv_str("tokenizer.ggml.tokens", "a");
  CHECK_THAT(error_of(tokens), Catch::Contains("'tokenizer.ggml.tokens' should be a list of strings"));
  GgufWriter bos = good;
  bos.kv_u32("tokenizer.ggml.add_bos_token", 1);
  CHECK_THAT(error_of(bos), Catch::Contains("'tokenizer.ggml.add_bos_token' should be true or false"));
}
