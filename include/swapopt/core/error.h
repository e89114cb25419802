#pragma once
/** swapopt's one exception type and the argument-check macro. */

#include <sstream>
#include <stdexcept>
#include <string>

namespace swapopt {

/** Thrown for every failure at the library boundary; what() names the operation and the values.
 *  An exception thrown by a callback of the caller's (MuonHooks, a schedule) passes through as
 *  it was thrown. */
class Error : public std::runtime_error {
 public:
  /** An error whose what() is `what`. */
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
[[noreturn]] void throw_error(const std::string& message);
}  // namespace detail

}  // namespace swapopt

/** Throws swapopt::Error with the streamed message when `cond` is false: SWAPOPT_CHECK(n > 0, "[op] bad n " << n). */
#define SWAPOPT_CHECK(cond, msg)                 \
  do {                                           \
    if (!(cond)) {                               \
      std::ostringstream swapopt_check_os_;      \
      swapopt_check_os_ << msg;                  \
      ::swapopt::detail::throw_error(swapopt_check_os_.str()); \
    }                                            \
  } while (0)

/** Unconditional throw with a streamed message. */
#define SWAPOPT_FAIL(msg) SWAPOPT_CHECK(false, msg)
