#pragma once
// A JSON value read as a whole number: a float, a string or a number outside the type's range is
// refused with comb::Error naming `what`, instead of being converted (a float beyond the range of
// int64 is undefined behaviour in the conversion).
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <string>

#include "comb/error.hpp"

namespace comb::detail {

template <typename T = int64_t>
T json_whole(const nlohmann::json& v, const std::string& what) {
  constexpr auto lo = std::numeric_limits<T>::min();
  constexpr auto hi = std::numeric_limits<T>::max();
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    COMB_CHECK(u <= static_cast<uint64_t>(hi), "{}: expected a whole number up to {}, found {}", what, hi, u);
    return static_cast<T>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    const bool fits = i < 0 ? (std::numeric_limits<T>::is_signed && i >= static_cast<int64_t>(lo))
                            : static_cast<uint64_t>(i) <= static_cast<uint64_t>(hi);
    COMB_CHECK(fits, "{}: expected a whole number from {} to {}, found {}", what, lo, hi, i);
    return static_cast<T>(i);
  }
  std::string found = v.dump();
  if (found.size() > 40) found = found.substr(0, 40) + "...";
  COMB_FAIL("{}: expected a whole number, found {}", what, found);
}

}  // namespace comb::detail
