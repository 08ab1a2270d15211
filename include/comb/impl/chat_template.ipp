// Chat templates recognised by their markers and rendered in C++ (see comb/chat_template.hpp).
// No LibTorch here. Compiled into libcomb (src/chat_template.cpp), or inline in every translation
// unit that defines COMB_HEADER_ONLY (comb::header_only); COMB_INLINE is `inline` there.
#pragma once
#include "comb/detail/inline.hpp"

#include <string>
#include <vector>

#include "comb/chat_template.hpp"
#include "comb/error.hpp"

namespace comb {

COMB_INLINE ChatTemplate::ChatTemplate(Family family, std::string default_system)
    : family_(family), default_system_(std::move(default_system)) {}

COMB_INLINE ChatTemplate ChatTemplate::from_source(const std::string& jinja) {
  if (jinja.find("<|im_start|>") != std::string::npos) {
    // A literal default system turn, e.g. '<|im_start|>system\nYou are ...<|im_end|>\n'.
    std::string system;
    const std::string head = "<|im_start|>system\n";
    size_t at = jinja.find(head);
    if (at != std::string::npos) {
      size_t b = at + head.size(), e = jinja.find("<|im_end|>", b);
      std::string text = e == std::string::npos ? "" : jinja.substr(b, e - b);
      if (text.find_first_of("'\"{}+") == std::string::npos) system = text;
    }
    return ChatTemplate(Family::chatml, system);
  }
  if (jinja.find("<|start_header_id|>") != std::string::npos) return ChatTemplate(Family::llama3);
  COMB_FAIL("chat template not recognised: expected ChatML (<|im_start|>) or Llama-3 (<|start_header_id|>) markers; "
            "pass --raw to send the prompt as is");
}

COMB_INLINE std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  std::string out;
  if (family_ == Family::chatml) {
    if (!default_system_.empty() && (messages.empty() || messages[0].role != "system"))
      out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
    for (const auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
  } else {
    auto trim = [](const std::string& s) {
      size_t b = s.find_first_not_of(" \t\n\r"), e = s.find_last_not_of(" \t\n\r");
      return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
    };
    out += "<|begin_of_text|>";
    for (const auto& m : messages)
      out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + trim(m.content) + "<|eot_id|>";
    if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  }
  return out;
}

COMB_INLINE std::string ChatTemplate::end_of_turn() const { return family_ == Family::chatml ? "<|im_end|>" : "<|eot_id|>"; }

}  // namespace comb
