// Stand-in for builds without NCCL (no CUDA, no Gloo bootstrap, or -Dnccl=disabled).
#include "swapopt/comm/communicator.h"
#include "swapopt/core/error.h"

namespace swapopt {

bool nccl_built() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator>, const Stream&, std::chrono::milliseconds) {
  SWAPOPT_FAIL("[comm] swapopt was built without NCCL (needs CUDA, Gloo and libnccl; reconfigure with -Dnccl=enabled)");
}

}  // namespace swapopt
