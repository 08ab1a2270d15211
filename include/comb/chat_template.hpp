#pragma once
// Chat templates of the supported families, recognised from the checkpoint's own template text.
#include <string>
#include <vector>

namespace comb {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

class ChatTemplate {
 public:
  enum class Family { chatml, llama3 };

  // Recognises the family from a Jinja template's markers (<|im_start|> or <|start_header_id|>)
  // and picks up its default system prompt, if it has one; throws comb::Error otherwise.
  static ChatTemplate from_source(const std::string& jinja);
  explicit ChatTemplate(Family family, std::string default_system = "");

  // The prompt text for `messages`, ending with the assistant header when `add_generation_prompt`.
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) const;
  // The token text that ends an assistant turn ("<|im_end|>" or "<|eot_id|>").
  std::string end_of_turn() const;
  Family family() const { return family_; }

 private:
  Family family_;
  std::string default_system_;
};

}  // namespace comb

// Header-only use (COMB_HEADER_ONLY, comb::header_only): the definitions, inline.
#ifdef COMB_HEADER_ONLY
#include "comb/impl/chat_template.ipp"
#endif
