#pragma once
// UTF-8 helpers without LibTorch.
#include <cstddef>
#include <string>

namespace comb::detail {

// The end of the longest prefix of s[0, n) that does not cut a UTF-8 character (n itself when
// s[n] starts one, or n is past the end).
inline size_t utf8_cut(const std::string& s, size_t n) {
  while (n > 0 && n < s.size() && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return n;
}

}  // namespace comb::detail
