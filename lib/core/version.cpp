#include "swapopt/version.h"

namespace swapopt {

const char* version() { return SWAPOPT_VERSION_STRING; }

}  // namespace swapopt
