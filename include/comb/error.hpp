#pragma once
// comb::Error and COMB_CHECK: every failure the library reports goes through here.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace comb {

// The one exception type comb throws; what() says what was expected, what was found, and where in
// the input (the option, file, line, tensor or key at fault). where() is the library source
// location of the check that failed ("file:line", or empty), kept out of the message: it is for
// whoever debugs comb, not for the user who gave the input.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, std::string where = "")
      : std::runtime_error(message), where_(std::move(where)) {}
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};

namespace detail {
[[noreturn]] inline void throw_error(const char* file, int line, const std::string& message) {
  throw Error(message, fmt::format("{}:{}", file, line));
}
}  // namespace detail

}  // namespace comb

// Throws comb::Error with a formatted message (and the source location as where()) when `cond` is false.
#define COMB_CHECK(cond, ...)                                                 \
  do {                                                                        \
    if (!(cond)) ::comb::detail::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

// Throws comb::Error unconditionally.
#define COMB_FAIL(...) ::comb::detail::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))
