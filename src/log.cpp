// The log callback: one per process, so it is compiled once (in comb_core), whichever way the rest
// of comb is used (compiled, or header-only).
#include "comb/log.hpp"

namespace comb {

namespace {
LogCallback& log_callback() {
  static LogCallback callback;
  return callback;
}
}  // namespace

void set_log_callback(LogCallback callback) { log_callback() = std::move(callback); }

namespace detail {
bool log_enabled() { return static_cast<bool>(log_callback()); }
void log_message(LogLevel level, const std::string& message) {
  if (!log_callback()) return;
  try {  // a message that cannot be written (a full disk under stderr) is lost, and the caller goes on
    log_callback()(level, message);
  } catch (...) {
  }
}
}  // namespace detail

}  // namespace comb
