#pragma once
/** Where a tensor's bytes live: the host CPU or one CUDA device. */

#include <string>

namespace swapopt {

/** The kind of a Device: the host CPU or a CUDA GPU. */
enum class DeviceType { cpu, cuda };

/** {cpu} or {cuda, index}. Pinned host memory is still Device::cpu(). */
struct Device {
  DeviceType type = DeviceType::cpu;  ///< CPU or CUDA.
  int index = 0;  ///< CUDA ordinal; always 0 for cpu

  /** The host CPU. */
  static Device cpu() { return {DeviceType::cpu, 0}; }
  /** CUDA device `index`; not checked here against the visible devices (allocators, streams and
   *  events on a missing device throw). */
  static Device cuda(int index = 0) { return {DeviceType::cuda, index}; }
  /** True for the host CPU. */
  bool is_cpu() const { return type == DeviceType::cpu; }
  /** True for a CUDA device. */
  bool is_cuda() const { return type == DeviceType::cuda; }
  /** Same type and index. */
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
