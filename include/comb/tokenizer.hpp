#pragma once
// Byte-level BPE tokenizer (GPT-2 and Llama-3 styles) with special tokens, loaded from GGUF
// metadata or a Hugging Face tokenizer.json.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace comb {

class GgufFile;

class Tokenizer {
 public:
  // From GGUF "tokenizer.ggml.*" metadata (model "gpt2"; pre-tokenizers gpt2, smollm, llama-bpe, ...).
  static Tokenizer from_gguf(const GgufFile& gguf);
  // From a tokenizer.json object (model BPE, byte-level); `where` names it in errors.
  static Tokenizer from_hf_json(const nlohmann::json& tokenizer, const std::string& where);
  static Tokenizer from_hf_file(const std::string& path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text`; special tokens written in the text become their ids when
  // `parse_special` (as Hugging Face tokenizers do). Adds no BOS.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // The text of `ids`; special tokens are dropped when `skip_special`.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // The raw bytes one token stands for (may be part of a UTF-8 character).
  std::string token_bytes(int32_t id) const;

  int64_t n_vocab() const;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  bool add_bos() const;
  bool is_special(int32_t id) const;
  // The id of a token by its exact text (e.g. "<|im_end|>"), if the vocabulary has it.
  std::optional<int32_t> find_token(std::string_view text) const;
  // The chat template the checkpoint ships (Jinja source), or "" if none.
  const std::string& chat_template() const;
  // Writes tokenizer.json and tokenizer_config.json (BOS/EOS, chat template) into `dir`.
  void save_hf(const std::string& dir) const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a token stream into text pieces that are always whole UTF-8 characters.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}
  // The complete characters that `id` finishes ("" while a character is still incomplete).
  std::string push(int32_t id);
  // Whatever is left (an incomplete trailing character, as is).
  std::string flush();

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/tokenizer.ipp"
#endif
