// Stand-in for builds without Gloo (-Dgloo=disabled or libgloo-dev missing).
#include "swapopt/comm/communicator.h"
#include "swapopt/core/error.h"

namespace swapopt {

std::unique_ptr<Communicator> make_gloo_communicator(const LaunchEnv&) {
  SWAPOPT_FAIL("[comm] swapopt was built without Gloo (install libgloo-dev and reconfigure with -Dgloo=enabled)");
}

}  // namespace swapopt
