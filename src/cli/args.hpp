#pragma once
// Command-line options of the comb tool ("--key value" and "--flag"), and its median.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "comb/error.hpp"

namespace comb::cli {

// Parsed "--key value" / "--flag" options, with the positions they came from for messages.
class Args {
 public:
  Args(int argc, char** argv, int first, const std::vector<std::string>& flags) {
    for (int i = first; i < argc; ++i) {
      std::string a = argv[i];
      if (a.rfind("--", 0) != 0) throw comb::Error("unexpected argument '" + a + "' (options start with --)");
      std::string key = a.substr(2);
      if (key == "help") throw comb::Error("help");
      if (std::find(flags.begin(), flags.end(), key) != flags.end()) {
        values_[key].push_back("1");
      } else {
        if (i + 1 >= argc) throw comb::Error("option --" + key + " needs a value");
        values_[key].push_back(argv[++i]);
      }
    }
  }
  bool has(const std::string& key) const { return values_.count(key) > 0; }
  std::string str(const std::string& key, const std::string& fallback = "") {
    used_.push_back(key);
    auto it = values_.find(key);
    return it == values_.end() ? fallback : it->second.back();
  }
  // Every value of an option, without counting it as used (for checks made before a command runs).
  std::vector<std::string> peek_all(const std::string& key) const {
    auto it = values_.find(key);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }
  // Every value of a repeatable option, in order.
  std::vector<std::string> all(const std::string& key) {
    used_.push_back(key);
    auto it = values_.find(key);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }
  // The option's value as a number, `fallback` when the option is absent. Whole-number options
  // take whole numbers in their type's range only: "2.5", "0x10", "1e30" and "-1" (for an unsigned
  // option) are refused, not rounded or wrapped; other options take any finite number.
  template <typename T>
  T num(const std::string& key, T fallback) {
    if (!has(key)) {
      used_.push_back(key);
      return fallback;
    }
    std::string s = str(key);
    auto refuse = [&](const std::string& expected) {
      return comb::Error("option --" + key + " expects " + expected + ", found '" + s + "'");
    };
    if constexpr (std::is_integral_v<T>) {
      const std::string range = "a whole number from " + std::to_string(std::numeric_limits<T>::min()) + " to " +
                                std::to_string(std::numeric_limits<T>::max());
      size_t first = !s.empty() && s[0] == '-' ? 1 : 0;
      bool digits = s.size() > first && std::all_of(s.begin() + first, s.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!digits) throw refuse(range);
      errno = 0;
      if constexpr (std::is_signed_v<T>) {
        long long v = std::strtoll(s.c_str(), nullptr, 10);
        if (errno == ERANGE || v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) throw refuse(range);
        return static_cast<T>(v);
      } else {
        unsigned long long v = std::strtoull(s.c_str(), nullptr, 10);
        if (first || errno == ERANGE || v > std::numeric_limits<T>::max()) throw refuse(range);
        return static_cast<T>(v);
      }
    } else {
      char* end = nullptr;
      errno = 0;
      double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
      if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v) ||
          std::abs(v) > static_cast<double>(std::numeric_limits<T>::max()))  // 1e39 is no float
        throw refuse("a finite number");
      return static_cast<T>(v);
    }
  }
  // Rejects options no one asked for (typos).
  void check_all_used() const {
    for (const auto& [k, v] : values_)
      if (std::find(used_.begin(), used_.end(), k) == used_.end()) throw comb::Error("unknown option --" + k);
  }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> used_;
};


// "a,b,,c" -> {"a", "b", "", "c"}: the items of a comma-separated option value ("" -> {}). Every
// comma separates two items, so "a," -> {"a", ""} and ",a" -> {"", "a"}: a caller that refuses
// empty items refuses a stray comma wherever it stands.
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  if (text.empty()) return out;
  for (size_t pos = 0;;) {
    const size_t comma = text.find(',', pos);
    out.push_back(text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (comma == std::string::npos) return out;
    pos = comma + 1;
  }
}

// split_list for a list of names or numbers: an empty item (a stray comma) is refused, with the
// option and its value.
inline std::vector<std::string> split_items(const std::string& text, const std::string& option) {
  std::vector<std::string> out = split_list(text);
  for (const std::string& item : out)
    if (item.empty())
      throw comb::Error("--" + option + ": an empty item in '" + text + "' (items are comma separated, none empty)");
  return out;
}

// "6,14,21" -> {6, 14, 21}: the value of a list option such as --cross-layers. Each item is
// digits with an optional leading '-' (no spaces, no '+'), within int64.
inline std::vector<int64_t> parse_int_list(const std::string& text, const std::string& option) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(text)) {
    try {
      const size_t digits = !item.empty() && item[0] == '-' ? 1 : 0;
      if (item.size() == digits || item.find_first_not_of("0123456789", digits) != std::string::npos)
        throw std::invalid_argument(item);
      out.push_back(std::stoll(item));
    } catch (const std::exception&) {
      throw comb::Error("--" + option + " expects comma-separated whole numbers, found '" + item + "'" +
                        (item == text ? std::string() : " in '" + text + "'"));
    }
  }
  return out;
}

// The median of `v` (0 when empty): what the tool reports for repeated measurements.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace comb::cli
