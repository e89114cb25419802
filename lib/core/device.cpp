#include "swapopt/core/device.h"

#include "../cuda/cuda_backend.h"

namespace swapopt {

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

bool cuda_built() { return cuda::built(); }

int cuda_device_count() { return cuda::device_count(); }

void use_device(Device device) {
  if (device.is_cuda()) cuda::set_process_device(device.index);
}

}  // namespace swapopt
