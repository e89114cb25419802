#include "swapopt/core/error.h"

namespace swapopt::detail {

void throw_error(const std::string& message) { throw Error(message); }

}  // namespace swapopt::detail
