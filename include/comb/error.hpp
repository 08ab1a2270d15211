#pragma once
// comb::Error and COMB_CHECK: every failure the library reports goes through here.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>

namespace comb {

// The one exception type comb throws; what() says what was expected, what was found, and where.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
[[noreturn]] inline void throw_error(const char* file, int line, const std::string& message) {
  throw Error(fmt::format("{} ({}:{})", message, file, line));
}
}  // namespace detail

}  // namespace comb

// Throws comb::Error with a formatted message and the source location when `cond` is false.
#define COMB_CHECK(cond, ...)                                                 \
  do {                                                                        \
    if (!(cond)) ::comb::detail::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

// Throws comb::Error unconditionally.
#define COMB_FAIL(...) ::comb::detail::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))
