#pragma once
// Logging: the library never prints; it hands messages to a callback the application sets.
#include <fmt/format.h>

#include <functional>
#include <string>

namespace comb {

enum class LogLevel { debug, info, warning };

using LogCallback = std::function<void(LogLevel, const std::string&)>;

// Replaces the log callback (the default drops every message). Not thread-safe against log().
void set_log_callback(LogCallback callback);

namespace detail {
void log_message(LogLevel level, const std::string& message);
bool log_enabled();
}  // namespace detail

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (detail::log_enabled()) detail::log_message(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace comb
