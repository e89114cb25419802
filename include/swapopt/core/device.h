#pragma once
/** Where a tensor's bytes live: the host CPU or one CUDA device. */

#include <string>

namespace swapopt {

enum class DeviceType { cpu, cuda };

/** {cpu} or {cuda, index}. Pinned host memory is still Device::cpu(). */
struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;  // CUDA ordinal; always 0 for cpu

  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device&) const = default;
  /** "cpu" or "cuda:N". */
  std::string str() const;
};

/** True when swapopt was built with the CUDA backend. */
bool cuda_built();

/** Number of visible CUDA devices; 0 when built without CUDA or when no driver/GPU is present. */
int cuda_device_count();

/** Makes `device` this process's CUDA device: current on the calling thread, and the device near
 *  which pinned host memory is allocated (no stray context on GPU 0). Call it once, before creating
 *  streams, in a rank that uses another GPU than 0 (LaunchEnv::device() gives LOCAL_RANK's). A CPU
 *  device changes nothing. swapopt's own calls make the device of their stream current for their
 *  duration and restore the caller's afterwards. */
void use_device(Device device);

}  // namespace swapopt
