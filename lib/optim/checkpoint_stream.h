#pragma once
// Checkpoints streamed between a file and the optimizer's own memory (internal): the state is
// never gathered into a StateDict, so saving or loading adds a bounded staging buffer to the
// process, not a copy of the state.

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "swapopt/core/stream.h"
#include "swapopt/core/tensor.h"
#include "swapopt/optim/checkpoint.h"

namespace swapopt {

/** Device state moves through host staging buffers of at most this many bytes. */
constexpr size_t kCheckpointChunkBytes = size_t(16) << 20;

/** Receives a tensor's bytes in order, piece by piece. */
using ByteSink = std::function<void(const void* data, size_t size)>;

/** One tensor to write: `produce(sink)` hands all its bytes, in order, to `sink` (it may be
 *  called twice: once for the checksums, once for the file). */
struct TensorSource {
  DType dtype = DType::f32;
  Shape shape;
  std::function<void(const ByteSink&)> produce;
};

/** A checkpoint to write, as a StateDict would hold it: tensors by name, and the metadata. */
struct CheckpointSource {
  std::map<std::string, TensorSource> tensors;
  std::string metadata;
};

/** One tensor to read: `read(to, offset, size)` fills `to` with its bytes [offset, offset+size).
 *  `data`, when not null, is all its bytes in host memory (then read is a memcpy from it). */
struct TensorReader {
  DType dtype = DType::f32;
  Shape shape;
  std::function<void(void* to, size_t offset, size_t size)> read;
  const void* data = nullptr;
};

/** A checkpoint to load: tensors by name, and the metadata. */
struct CheckpointReader {
  std::map<std::string, TensorReader> tensors;
  std::string metadata;
};

/** `host`'s bytes, straight from its memory. */
TensorSource host_source(const Tensor& host);
/** `device`'s bytes (dense, contiguous), copied to the host on `stream` one staging buffer at a
 *  time; host memory is read directly. */
TensorSource device_source(Stream& stream, const Tensor& device);
/** Fills `device` (dense, contiguous) from `reader` on `stream`: directly from the reader's
 *  memory when it has some (no wait), else one staging buffer at a time (waits for each). */
void fill_from(Stream& stream, const Tensor& device, const TensorReader& reader);

/** Writes `source` atomically (temp, fsync, rename), byte for byte what save_state_dict writes
 *  for the StateDict of the same tensors: the checksums in a first pass over the sources, then
 *  the header and the bytes. `on_written(name)` runs once a tensor's bytes are written (its
 *  source is not read again). */
void write_checkpoint(const CheckpointSource& source, const std::string& path,
                      const std::function<void(const std::string& name)>& on_written = {});

/** Readers over `state`'s tensors (in memory: no copy). */
CheckpointReader reader_of(const StateDict& state);

/** A checkpoint file opened for streaming: the header is parsed and every checksum verified (the
 *  file read once in staging-sized pieces) before reader() is handed out; its readers read the
 *  file again, piece by piece, into the memory they are given. The file must not change until
 *  loading is done. */
class ReadFile;

class CheckpointFile {
 public:
  CheckpointFile(const std::string& path, const CheckpointReadOptions& options);
  ~CheckpointFile();
  CheckpointFile(const CheckpointFile&) = delete;
  CheckpointFile& operator=(const CheckpointFile&) = delete;
  const CheckpointReader& reader() const { return reader_; }

 private:
  std::unique_ptr<ReadFile> file_;
  CheckpointReader reader_;
};

}  // namespace swapopt
