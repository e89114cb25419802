// safetensors: 8-byte little-endian header size, JSON header, then the tensors' bytes.
#include "swapopt/optim/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string_view>
#include <vector>

#include "checkpoint_stream.h"
#include "json.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"

namespace swapopt {

namespace {

const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
  }
  return "?";
}

DType dtype_from_safetensors(const std::string& name, const std::string& tensor) {
  if (name == "F32") return DType::f32;
  if (name == "BF16") return DType::bf16;
  if (name == "F16") return DType::f16;
  SWAPOPT_FAIL("[checkpoint] tensor '" << tensor << "' has unsupported dtype '" << name << "'");
}

constexpr const char* kChecksumsKey = "swapopt.crc32";
constexpr const char* kMetadataChecksum = "__metadata__";

/** `crc` continued over `size` more bytes (start from crc32_of(nullptr, 0)). */
uint32_t crc32_update(uint32_t crc, const void* data, size_t size) {
  uLong out = crc;
  const auto* bytes = static_cast<const Bytef*>(data);
  while (size > 0) {  // zlib takes at most a uInt per call
    const uInt chunk = uInt(std::min<size_t>(size, size_t(1) << 30));
    out = crc32(out, bytes, chunk);
    bytes += chunk;
    size -= chunk;
  }
  return uint32_t(out);
}

uint32_t crc32_of(const void* data, size_t size) { return crc32_update(uint32_t(crc32(0L, Z_NULL, 0)), data, size); }

// Bounds that keep a corrupt header from asking for absurd sizes; a save refuses what a load would.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
constexpr int64_t kMaxDims = 64;
constexpr uint64_t kMaxEmptyExtent = uint64_t(1) << 32;  // the product of an empty tensor's nonzero dims

/** At most kMaxDims dims in the tensor `what` ("tensor 'name'"): the load counts them before it
 *  reads them. */
void check_dim_count(const std::string& what, size_t dims) {
  SWAPOPT_CHECK(int64_t(dims) <= kMaxDims,
                "[checkpoint] " << what << " has " << dims << " dims: a checkpoint holds at most " << kMaxDims);
}

/** The bounds on the shape of the tensor `what` that the save and the load both check: at most
 *  kMaxDims dims, none negative, and in an empty tensor (a dim of 0, no bytes) the other dims,
 *  which its strides multiply, at most kMaxEmptyExtent together. Returns whether it is empty. */
bool check_header_shape(const std::string& what, const Shape& shape) {
  check_dim_count(what, shape.size());
  const bool empty = std::find(shape.begin(), shape.end(), 0) != shape.end();
  uint64_t extent = 1;
  for (const int64_t dim : shape) {
    SWAPOPT_CHECK(dim >= 0, "[checkpoint] " << what << " has negative dim " << dim);
    SWAPOPT_CHECK(!empty || uint64_t(dim) <= kMaxEmptyExtent / extent,
                  "[checkpoint] " << what << " has no elements but dims " << shape_str(shape) << " beyond "
                                  << kMaxEmptyExtent << " together");
    if (dim > 0) extent *= uint64_t(dim);
  }
  return empty;
}

}  // namespace

namespace {

/** What the header says of one tensor it lists. */
struct HeaderTensor {
  const std::string* name;
  DType dtype;
  const Shape* shape;
  uint64_t nbytes;
  uint32_t crc;
};

/** The 8-byte size and the JSON header (padded to 8 bytes): everything before the tensors'
 *  bytes, which follow in the order given (the names' order). */
std::string header_bytes(const std::string& metadata, const std::vector<HeaderTensor>& tensors) {
  using json::Value;
  Value header = Value::object();
  Value checksums = Value::object();
  checksums[kMetadataChecksum] = crc32_of(metadata.data(), metadata.size());
  uint64_t offset = 0;
  for (const HeaderTensor& t : tensors) {
    const std::string& name = *t.name;
    SWAPOPT_CHECK(name != "__metadata__",
                  "[checkpoint] a tensor cannot be named '__metadata__': the format keeps that name for the metadata");
    check_header_shape(std::string("tensor '").append(name).append("'"), *t.shape);
    header[*t.name] = Value::object({{"dtype", safetensors_dtype(t.dtype)},
                                     {"shape", *t.shape},
                                     {"data_offsets", Value::array({offset, offset + t.nbytes})}});
    offset += t.nbytes;
    checksums[*t.name] = t.crc;
  }
  header["__metadata__"] =
      Value::object({{"swapopt", metadata}, {kChecksumsKey, json::dump(checksums, "the tensor names")}});
  std::string text = json::dump(header, "the checkpoint header");
  text.append((8 - text.size() % 8) % 8, ' ');  // the format pads the header to 8 bytes with spaces
  SWAPOPT_CHECK(text.size() <= kMaxHeaderBytes, "[checkpoint] the header would take "
                                                    << text.size() << " bytes (metadata " << metadata.size() << ", "
                                                    << tensors.size() << " tensor names): a checkpoint holds at most "
                                                    << kMaxHeaderBytes);
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + text;
}

/** What a StateDict's tensors and metadata must be to be written or loaded: named errors. */
void check_state_dict_tensor(const std::string& name, const Tensor& tensor) {
  SWAPOPT_CHECK(tensor.defined() && !tensor.is_released(),
                "[checkpoint] tensor '" << name << "' is " << (tensor.defined() ? "released" : "undefined"));
  SWAPOPT_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(),
                "[checkpoint] tensor '" << name << "' must be a contiguous host tensor, got " << tensor.str());
}
void check_state_dict_metadata(const StateDict& state) {
  SWAPOPT_CHECK(!state.metadata.empty(), "[checkpoint] no swapopt metadata in the state dict");
}

std::string header_bytes(const StateDict& state) {
  check_state_dict_metadata(state);
  std::vector<HeaderTensor> tensors;
  for (const auto& [name, tensor] : state.tensors) {
    check_state_dict_tensor(name, tensor);
    tensors.push_back({&name, tensor.dtype(), &tensor.shape(), tensor.nbytes(), crc32_of(tensor.data_ptr(), tensor.nbytes())});
  }
  return header_bytes(state.metadata, tensors);
}

/** A tensor as the header describes it: where its bytes lie among the data bytes. */
struct TensorEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

/** A checked header: every entry's bytes inside the data, none overlapping, no gap. */
struct Header {
  std::string metadata;
  std::optional<json::Value> checksums;
  std::vector<TensorEntry> tensors;
};

uint64_t read_header_size(const unsigned char* bytes, uint64_t file_size) {
  uint64_t header_size = 0;
  for (int i = 0; i < 8; ++i) header_size |= uint64_t(bytes[i]) << (8 * i);
  SWAPOPT_CHECK(header_size <= kMaxHeaderBytes && header_size <= file_size - 8,
                "[checkpoint] header size " << header_size << " does not fit a file of " << file_size << " bytes");
  return header_size;
}

Header parse_header(std::string_view text, uint64_t data_size) {
  const json::Value header = json::parse(text);
  Header out;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : json::get_object(header, "header")) {
    if (name == "__metadata__") {
      for (const auto& [key, value] : json::get_object(entry, "__metadata__"))
        SWAPOPT_CHECK(key == "swapopt" || key == kChecksumsKey, "[checkpoint] unknown __metadata__ entry '" << key << "'");
      out.metadata = json::get_string(json::member(entry, "swapopt", "__metadata__"), "__metadata__.swapopt");
      if (entry.contains(kChecksumsKey))
        out.checksums = json::parse(json::get_string(json::member(entry, kChecksumsKey, "__metadata__"), kChecksumsKey));
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    const DType dtype = dtype_from_safetensors(json::get_string(json::member(entry, "dtype", what), what + " dtype"), name);
    const auto& dims = json::get_array(json::member(entry, "shape", what), what + " shape");
    check_dim_count(what, dims.size());  // before a long list is read
    Shape shape;
    for (const json::Value& d : dims) shape.push_back(json::get_int(d, what + " shape"));
    const bool empty = check_header_shape(what, shape);
    // A non-empty tensor's dims are each at most the data bytes.
    uint64_t numel = 1;
    for (const int64_t dim : shape) {
      SWAPOPT_CHECK(empty || dim <= int64_t(data_size),
                    "[checkpoint] " << what << " has dim " << dim << ", more than the " << data_size
                                    << " data bytes of the file (is it cut short?)");
      numel = dim == 0 ? 0 : (numel > data_size / uint64_t(dim) ? data_size + 1 : numel * uint64_t(dim));
    }
    if (empty) numel = 0;
    const auto& offsets = json::get_array(json::member(entry, "data_offsets", what), what + " data_offsets");
    SWAPOPT_CHECK(offsets.size() == 2, "[checkpoint] " << what << " needs two data_offsets");
    const int64_t begin = json::get_int(offsets[0], what + " data_offsets"), end = json::get_int(offsets[1], what + " data_offsets");
    SWAPOPT_CHECK(begin >= 0 && end >= begin && uint64_t(end) <= data_size,
                  "[checkpoint] " << what << " data_offsets [" << begin << ", " << end << ") outside " << data_size
                                  << " data bytes (is the file cut short?)");
    SWAPOPT_CHECK(numel <= data_size && uint64_t(end - begin) == numel * dtype_size(dtype),
                  "[checkpoint] " << what << " covers " << (end - begin) << " bytes, its shape " << shape_str(shape)
                                  << " needs " << numel * dtype_size(dtype));
    ranges.emplace_back(uint64_t(begin), uint64_t(end));
    out.tensors.push_back({name, dtype, shape, uint64_t(begin), uint64_t(end)});
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    SWAPOPT_CHECK(begin == covered, "[checkpoint] tensor data overlaps or leaves a gap at byte " << covered);
    covered = end;
  }
  SWAPOPT_CHECK(covered == data_size, "[checkpoint] " << data_size - covered << " trailing data bytes");
  SWAPOPT_CHECK(!out.metadata.empty(), "[checkpoint] no swapopt metadata in the header");
  return out;
}

/** Checks `header`'s tensors against its checksums, `crc_of(entry)` computing each tensor's:
 *  every tensor and the metadata must have one that matches, and every checksum must name
 *  something the file holds. */
void verify_checksums(const Header& header, const CheckpointReadOptions& options,
                      const std::function<uint32_t(const TensorEntry&)>& crc_of) {
  if (!header.checksums) {
    SWAPOPT_CHECK(options.allow_missing_checksums,
                  "[checkpoint] the file has no checksums (written before swapopt 0.2, or by another tool): load it with "
                  "CheckpointReadOptions::allow_missing_checksums to accept it unverified");
    return;
  }
  const auto& stored = json::get_object(*header.checksums, kChecksumsKey);
  auto check = [&](const std::string& name, uint32_t got) {
    const auto it = stored.find(name);
    SWAPOPT_CHECK(it != stored.end(), "[checkpoint] '" << name << "' has no checksum");
    const int64_t want = json::get_int(it->second, std::string(kChecksumsKey) + " of '" + name + "'");
    SWAPOPT_CHECK(want == int64_t(got), "[checkpoint] '" << name << "' fails its checksum (stored " << want << ", computed "
                                                         << got << "): the file is corrupt");
  };
  check(kMetadataChecksum, crc32_of(header.metadata.data(), header.metadata.size()));
  std::map<std::string, const TensorEntry*> by_name;  // the checks in name order, as a StateDict holds them
  for (const TensorEntry& e : header.tensors) by_name.emplace(e.name, &e);
  for (const auto& [name, entry] : by_name) check(name, crc_of(*entry));
  for (const auto& [name, value] : stored)
    SWAPOPT_CHECK(name == kMetadataChecksum || by_name.count(name) != 0,
                  "[checkpoint] the checksums name tensor '" << name << "', which the file does not hold");
}

/** The tensors of `header`, each filled by `read(entry, destination)`, then verified. */
StateDict read_tensors(const Header& header, const CheckpointReadOptions& options,
                       const std::function<void(const TensorEntry&, void*)>& read) {
  StateDict out;
  out.metadata = header.metadata;
  for (const TensorEntry& e : header.tensors) {
    Tensor t = Tensor::empty(e.shape, e.dtype, Device::cpu());
    if (t.nbytes() > 0) read(e, t.data_ptr());
    out.tensors.emplace(e.name, t);
  }
  verify_checksums(header, options, [&](const TensorEntry& e) {
    const Tensor& t = out.tensors.at(e.name);
    return crc32_of(t.data_ptr(), t.nbytes());
  });
  return out;
}

/** A file written under `path`.tmp and committed by rename after an fsync (or removed). The writer
 *  holds an exclusive flock on the temporary from its creation to its rename, so writers of one
 *  path on one host (threads or processes) take turns instead of writing into one file: each
 *  commits a whole file, the later one last, and a writer waits while another holds the lock. A
 *  writer that died left its temporary unlocked; the next one empties it and writes it anew. */
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path) : path_(path), tmp_(path + ".tmp") {
    // A writer woken from flock may hold a file the previous one has since renamed to `path` (or
    // removed): it opens the temporary again until the file it locked is the one named `tmp_`.
    for (;;) {
      fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      int err = errno;
      SWAPOPT_CHECK(fd_ >= 0, "[checkpoint] cannot create '" << tmp_ << "': " << std::strerror(err));
      // A file system without locks (ENOLCK, EOPNOTSUPP) still saves: one writer at a time then.
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
      struct stat locked {
      }, named{};
      if (::fstat(fd_, &locked) != 0) give_up("stat", errno);
      if (::stat(tmp_.c_str(), &named) == 0 && named.st_dev == locked.st_dev && named.st_ino == locked.st_ino) {
        // A regular file may hold a dead writer's bytes; anything else (a FIFO) is written as is.
        if (S_ISREG(locked.st_mode) && ::ftruncate(fd_, 0) != 0) give_up("empty", errno);
        return;
      }
      release();
    }
  }
  ~AtomicFile() {  // not committed: an error left a partial file behind, removed under the lock
    if (fd_ < 0) return;
    if (!committed_) ::unlink(tmp_.c_str());
    release();
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t size) {
    const char* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, bytes, size);
      const int err = n < 0 ? errno : EIO;
      if (n < 0 && err == EINTR) continue;
      SWAPOPT_CHECK(n > 0, "[checkpoint] writing '" << tmp_ << "' failed: " << std::strerror(err));
      bytes += n;
      size -= size_t(n);
    }
  }
  void commit() {
    int err = ::fsync(fd_) == 0 ? 0 : errno;
    if (err == 0 && std::rename(tmp_.c_str(), path_.c_str()) != 0) err = errno;
    SWAPOPT_CHECK(err == 0, "[checkpoint] cannot commit '" << path_ << "': " << std::strerror(err));
    committed_ = true;
    const int close_err = release();
    // The rename lives in the directory: until it is synced too, a power loss may bring back the
    // previous file (or none) although this one was reported written.
    const std::string dir = std::filesystem::path(path_).parent_path().string();
    const int dir_fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    err = dir_fd < 0 || ::fsync(dir_fd) != 0 ? errno : 0;
    if (dir_fd >= 0) ::close(dir_fd);
    SWAPOPT_CHECK(close_err == 0,
                  "[checkpoint] '" << path_ << "' is written but closing it failed: " << std::strerror(close_err));
    SWAPOPT_CHECK(err == 0, "[checkpoint] '" << path_ << "' is written but its directory could not be synced: " << std::strerror(err));
  }

 private:
  /** Unlocks and closes the file; returns close's error. Unlocked first: a child forked meanwhile
   *  shares the lock (it belongs to the open file, which the child holds too) until it exits. */
  int release() {
    ::flock(fd_, LOCK_UN);
    const int err = ::close(fd_) == 0 ? 0 : errno;
    fd_ = -1;
    return err;
  }
  /** Releases the temporary this writer locked (left as it is) and throws. */
  [[noreturn]] void give_up(const char* doing, int err) {
    release();
    SWAPOPT_FAIL("[checkpoint] cannot " << doing << " '" << tmp_ << "': " << std::strerror(err));
  }

  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

/** A checkpoint file open for reading (closed with this object). */
class ReadFile {
 public:
  explicit ReadFile(const std::string& path) : path_(path) {
    // Non-blocking, so that opening a FIFO returns (it is refused below) instead of waiting for a
    // writer; reads of a regular file ignore the flag.
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    const int err = errno;
    SWAPOPT_CHECK(fd_ >= 0, "[checkpoint] cannot open '" << path << "': " << std::strerror(err));
    if (::fstat(fd_, &opened_) != 0) {
      const int stat_err = errno;
      ::close(fd_);
      SWAPOPT_FAIL("[checkpoint] cannot stat '" << path << "': " << std::strerror(stat_err));
    }
    if (!S_ISREG(opened_.st_mode)) {
      ::close(fd_);
      SWAPOPT_FAIL("[checkpoint] cannot read '" << path << "': not a regular file");
    }
    ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);  // reads block as usual (some file systems heed it)
  }
  ~ReadFile() { ::close(fd_); }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return uint64_t(opened_.st_size); }
  /** Reads `size` bytes at `offset`, or throws naming the file. */
  void read_at(void* to, uint64_t size, uint64_t offset) const {
    char* bytes = static_cast<char*>(to);
    while (size > 0) {
      const ssize_t got = ::pread(fd_, bytes, size_t(std::min<uint64_t>(size, uint64_t(1) << 30)), off_t(offset));
      const int err = errno;
      if (got < 0 && err == EINTR) continue;
      SWAPOPT_CHECK(got > 0, "[checkpoint] reading '" << path_ << "' failed at byte " << offset << ": "
                                                      << (got < 0 ? std::strerror(err) : "the file ended early"));
      bytes += got;
      size -= uint64_t(got);
      offset += uint64_t(got);
    }
  }
  /** Whether the file still has the size and modification time it was opened with. */
  bool unchanged() const {
    struct stat now {};
    return ::fstat(fd_, &now) == 0 && now.st_size == opened_.st_size && now.st_mtim.tv_sec == opened_.st_mtim.tv_sec &&
           now.st_mtim.tv_nsec == opened_.st_mtim.tv_nsec;
  }

 private:
  std::string path_;
  int fd_ = -1;
  struct stat opened_ {};
};

namespace {

/** The header of an open checkpoint file (size checked, parsed); its tensors' data starts at
 *  `payload`. */
Header read_file_header(const ReadFile& file, uint64_t& payload) {
  const uint64_t size = file.size();
  SWAPOPT_CHECK(size >= 8, "[checkpoint] file of " << size << " bytes is too short for a safetensors header");
  unsigned char size_bytes[8];
  file.read_at(size_bytes, 8, 0);
  const uint64_t header_size = read_header_size(size_bytes, size);
  std::string text(size_t(header_size), '\0');
  file.read_at(text.data(), header_size, 8);
  payload = 8 + header_size;
  return parse_header(text, size - payload);
}
}  // namespace

std::string serialize_state_dict(const StateDict& state) {
  std::string out = header_bytes(state);
  for (const auto& [name, tensor] : state.tensors)
    if (tensor.nbytes() > 0) out.append(static_cast<const char*>(tensor.data_ptr()), tensor.nbytes());
  return out;
}

StateDict parse_state_dict(const void* data, size_t size, const CheckpointReadOptions& options) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  SWAPOPT_CHECK(data != nullptr || size == 0, "[checkpoint] null data of " << size << " bytes");
  SWAPOPT_CHECK(size >= 8, "[checkpoint] file of " << size << " bytes is too short for a safetensors header");
  const uint64_t header_size = read_header_size(bytes, size);
  const Header header =
      parse_header(std::string_view(reinterpret_cast<const char*>(bytes + 8), size_t(header_size)), size - 8 - header_size);
  const unsigned char* payload = bytes + 8 + header_size;
  return read_tensors(header, options,
                      [&](const TensorEntry& e, void* to) { std::memcpy(to, payload + e.begin, e.end - e.begin); });
}

void save_state_dict(const StateDict& state, const std::string& path) {
  // The header, then each tensor's bytes straight from its memory: no copy of the whole file.
  const std::string header = header_bytes(state);
  AtomicFile file(path);
  file.write(header.data(), header.size());
  for (const auto& [name, tensor] : state.tensors)
    if (tensor.nbytes() > 0) file.write(tensor.data_ptr(), tensor.nbytes());
  file.commit();
}

StateDict load_state_dict(const std::string& path, const CheckpointReadOptions& options) {
  // The header first, then each tensor read from the file into its own memory: no copy of the
  // whole file is ever held.
  const ReadFile file(path);
  uint64_t payload = 0;
  const Header header = read_file_header(file, payload);
  return read_tensors(header, options,
                      [&](const TensorEntry& e, void* to) { file.read_at(to, e.end - e.begin, payload + e.begin); });
}

// ---- streamed checkpoints (checkpoint_stream.h) ----------------------------------------------

TensorSource host_source(const Tensor& host) {
  return {host.dtype(), host.shape(), [host](const ByteSink& sink) {
            if (host.nbytes() > 0) sink(host.data_ptr(), host.nbytes());
          }};
}

namespace {

/** Flat views of `t` (dense, contiguous) in pieces of at most kCheckpointChunkBytes: calls
 *  `each(view, byte offset)` in order. */
void for_each_chunk(const Tensor& t, const std::function<void(const Tensor&, size_t)>& each) {
  const size_t element = dtype_size(t.dtype());
  const int64_t per_chunk = int64_t(kCheckpointChunkBytes / element), total = t.numel();
  for (int64_t begin = 0; begin < total; begin += per_chunk) {
    const int64_t n = std::min(per_chunk, total - begin);
    each(Tensor::on_storage(t.storage(), t.offset() + begin, {n}, t.dtype()), size_t(begin) * element);
  }
}

void check_dense(const Tensor& t) {
  SWAPOPT_CHECK(t.is_contiguous(), "[checkpoint] state tensor must be contiguous to stream, got " << t.str());
}

}  // namespace

TensorSource device_source(Stream& stream, const Tensor& device) {
  check_dense(device);
  // Through the staging buffer on every backend (also where host code could read the memory
  // directly): the CPU backend runs and tests the path CUDA takes.
  return {device.dtype(), device.shape(), [stream, device](const ByteSink& sink) mutable {
            const Tensor staging = Tensor::empty({std::min<int64_t>(device.numel(), int64_t(kCheckpointChunkBytes / dtype_size(device.dtype())))},
                                                 device.dtype(), Device::cpu());
            for_each_chunk(device, [&](const Tensor& chunk, size_t) {
              const Tensor into = Tensor::on_storage(staging.storage(), 0, chunk.shape(), chunk.dtype());
              ops::copy(stream, chunk, into);
              stream.synchronize();
              sink(into.data_ptr(), into.nbytes());
            });
          }};
}

void fill_from(Stream& stream, const Tensor& device, const TensorReader& reader) {
  check_dense(device);
  if (device.nbytes() == 0) return;
  if (reader.data != nullptr) {  // in host memory already: one copy, no wait
    ops::copy(stream, Tensor::from_blob(const_cast<void*>(reader.data), device.shape(), device.dtype(), Device::cpu()), device);
    return;
  }
  const Tensor staging = Tensor::empty({std::min<int64_t>(device.numel(), int64_t(kCheckpointChunkBytes / dtype_size(device.dtype())))},
                                       device.dtype(), Device::cpu());
  for_each_chunk(device, [&](const Tensor& chunk, size_t offset) {
    const Tensor from = Tensor::on_storage(staging.storage(), 0, chunk.shape(), chunk.dtype());
    reader.read(from.data_ptr(), offset, from.nbytes());
    ops::copy(stream, from, chunk);
    stream.synchronize();  // the staging buffer is filled again next
  });
}

void write_checkpoint(const CheckpointSource& source, const std::string& path,
                      const std::function<void(const std::string& name)>& on_written) {
  std::vector<HeaderTensor> tensors;
  for (const auto& [name, t] : source.tensors) {
    uint32_t crc = crc32_of(nullptr, 0);
    uint64_t nbytes = 0;
    t.produce([&](const void* data, size_t size) {
      crc = crc32_update(crc, data, size);
      nbytes += size;
    });
    SWAPOPT_CHECK(nbytes == uint64_t(shape_numel(t.shape)) * dtype_size(t.dtype),
                  "[checkpoint] tensor '" << name << "' produced " << nbytes << " bytes for its shape " << shape_str(t.shape));
    tensors.push_back({&name, t.dtype, &t.shape, nbytes, crc});
  }
  const std::string header = header_bytes(source.metadata, tensors);
  AtomicFile file(path);
  file.write(header.data(), header.size());
  for (const auto& [name, t] : source.tensors) {
    t.produce([&](const void* data, size_t size) { file.write(data, size); });
    if (on_written) on_written(name);
  }
  file.commit();
}

CheckpointReader reader_of(const StateDict& state) {
  check_state_dict_metadata(state);
  CheckpointReader out;
  out.metadata = state.metadata;
  for (const auto& [name, tensor] : state.tensors) {
    check_state_dict_tensor(name, tensor);
    const void* data = tensor.nbytes() > 0 ? tensor.data_ptr() : nullptr;
    // In name order, as the map keeps them: each goes at the end, in constant time.
    out.tensors.emplace_hint(out.tensors.end(), name,
                             TensorReader{tensor.dtype(), tensor.shape(),
                                          [data](void* to, size_t offset, size_t size) {
                                            std::memcpy(to, static_cast<const char*>(data) + offset, size);
                                          },
                                          data});
  }
  return out;
}

CheckpointFile::CheckpointFile(const std::string& path, const CheckpointReadOptions& options)
    : file_(std::make_unique<ReadFile>(path)) {
  uint64_t payload = 0;
  const Header header = read_file_header(*file_, payload);
  // Verified before anything reads it for real: each tensor's checksum over staging-sized pieces.
  const size_t piece = size_t(std::min<uint64_t>(kCheckpointChunkBytes, file_->size()));
  const std::unique_ptr<char[]> buffer(new char[std::max<size_t>(piece, 1)]);
  verify_checksums(header, options, [&](const TensorEntry& e) {
    uint32_t crc = crc32_of(nullptr, 0);
    for (uint64_t at = e.begin; at < e.end;) {
      const uint64_t n = std::min<uint64_t>(piece, e.end - at);
      file_->read_at(buffer.get(), n, payload + at);
      crc = crc32_update(crc, buffer.get(), size_t(n));
      at += n;
    }
    return crc;
  });
  reader_.metadata = header.metadata;
  for (const TensorEntry& e : header.tensors) {
    const uint64_t begin = payload + e.begin;
    reader_.tensors.emplace(e.name, TensorReader{e.dtype, e.shape, [this, begin](void* to, size_t offset, size_t size) {
                                                   // After the checks: a failure now leaves a load half done.
                                                   try {
                                                     SWAPOPT_CHECK(file_->unchanged(), "the file changed after its checksums were verified");
                                                     file_->read_at(to, size, begin + offset);
                                                   } catch (const std::exception& e) {
                                                     SWAPOPT_FAIL("[checkpoint] loading '" << file_->path()
                                                                  << "' failed after its checks, so the optimizer's state is now "
                                                                     "incomplete: load a checkpoint again before stepping ("
                                                                  << e.what() << ")");
                                                   }
                                                 }});
  }
}

CheckpointFile::~CheckpointFile() = default;

}  // namespace swapopt
