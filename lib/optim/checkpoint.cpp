// safetensors: 8-byte little-endian header size, JSON header, then the tensors' bytes.
#include "swapopt/optim/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "json.h"
#include "swapopt/core/error.h"

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

uint32_t crc32_of(const void* data, size_t size) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* bytes = static_cast<const Bytef*>(data);
  while (size > 0) {  // zlib takes at most a uInt per call
    const uInt chunk = uInt(std::min<size_t>(size, size_t(1) << 30));
    crc = crc32(crc, bytes, chunk);
    bytes += chunk;
    size -= chunk;
  }
  return uint32_t(crc);
}

// Bounds that keep a corrupt header from asking for absurd sizes.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
constexpr int64_t kMaxDims = 8;

}  // namespace

namespace {

/** The 8-byte size and the JSON header of `state`'s file (padded to 8 bytes): everything before
 *  the tensors' bytes, which follow in the map's order. */
std::string header_bytes(const StateDict& state) {
  using json::Value;
  Value header = Value::object();
  Value checksums = Value::object();
  checksums[kMetadataChecksum] = crc32_of(state.metadata.data(), state.metadata.size());
  uint64_t offset = 0;
  for (const auto& [name, tensor] : state.tensors) {
    SWAPOPT_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(),
                  "[checkpoint] tensor '" << name << "' must be a contiguous host tensor, got " << tensor.str());
    header[name] = Value::object({{"dtype", safetensors_dtype(tensor.dtype())},
                                  {"shape", tensor.shape()},
                                  {"data_offsets", Value::array({offset, offset + tensor.nbytes()})}});
    offset += tensor.nbytes();
    checksums[name] = crc32_of(tensor.data_ptr(), tensor.nbytes());
  }
  header["__metadata__"] =
      Value::object({{"swapopt", state.metadata}, {kChecksumsKey, json::dump(checksums, "the tensor names")}});
  std::string text = json::dump(header, "the checkpoint header");
  text.append((8 - text.size() % 8) % 8, ' ');  // the format pads the header to 8 bytes with spaces
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + text;
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
    SWAPOPT_CHECK(int64_t(dims.size()) <= kMaxDims, "[checkpoint] " << what << " has " << dims.size() << " dims");
    Shape shape;
    uint64_t numel = 1;
    for (const json::Value& d : dims) {
      const int64_t dim = json::get_int(d, what + " shape");
      SWAPOPT_CHECK(dim >= 0 && dim <= int64_t(data_size), "[checkpoint] " << what << " has bad dim " << dim);
      shape.push_back(dim);
      numel = dim == 0 ? 0 : (numel > data_size / uint64_t(dim) ? data_size + 1 : numel * uint64_t(dim));
    }
    const auto& offsets = json::get_array(json::member(entry, "data_offsets", what), what + " data_offsets");
    SWAPOPT_CHECK(offsets.size() == 2, "[checkpoint] " << what << " needs two data_offsets");
    const int64_t begin = json::get_int(offsets[0], what + " data_offsets"), end = json::get_int(offsets[1], what + " data_offsets");
    SWAPOPT_CHECK(begin >= 0 && end >= begin && uint64_t(end) <= data_size,
                  "[checkpoint] " << what << " data_offsets [" << begin << ", " << end << ") outside " << data_size
                                  << " data bytes");
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

/** The tensors of `header`, each filled by `read(entry, destination)`, then checked against the
 *  checksums: every tensor and the metadata must have one that matches, and every checksum must
 *  name something the file holds. */
StateDict read_tensors(const Header& header, const CheckpointReadOptions& options,
                       const std::function<void(const TensorEntry&, void*)>& read) {
  StateDict out;
  out.metadata = header.metadata;
  for (const TensorEntry& e : header.tensors) {
    Tensor t = Tensor::empty(e.shape, e.dtype, Device::cpu());
    if (t.nbytes() > 0) read(e, t.data_ptr());
    out.tensors.emplace(e.name, t);
  }
  if (!header.checksums) {
    SWAPOPT_CHECK(options.allow_missing_checksums,
                  "[checkpoint] the file has no checksums (written before swapopt 0.2, or by another tool): load it with "
                  "CheckpointReadOptions::allow_missing_checksums to accept it unverified");
    return out;
  }
  const auto& stored = json::get_object(*header.checksums, kChecksumsKey);
  auto check = [&](const std::string& name, const void* bytes, size_t n) {
    const auto it = stored.find(name);
    SWAPOPT_CHECK(it != stored.end(), "[checkpoint] '" << name << "' has no checksum");
    const int64_t want = json::get_int(it->second, std::string(kChecksumsKey) + " of '" + name + "'");
    const uint32_t got = crc32_of(bytes, n);
    SWAPOPT_CHECK(want == int64_t(got), "[checkpoint] '" << name << "' fails its checksum (stored " << want << ", computed "
                                                         << got << "): the file is corrupt");
  };
  check(kMetadataChecksum, out.metadata.data(), out.metadata.size());
  for (const auto& [name, tensor] : out.tensors) check(name, tensor.data_ptr(), tensor.nbytes());
  for (const auto& [name, value] : stored)
    SWAPOPT_CHECK(name == kMetadataChecksum || out.tensors.count(name) != 0,
                  "[checkpoint] the checksums name tensor '" << name << "', which the file does not hold");
  return out;
}

/** An open file descriptor, closed on every path. */
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string serialize_state_dict(const StateDict& state) {
  std::string out = header_bytes(state);
  for (const auto& [name, tensor] : state.tensors)
    if (tensor.nbytes() > 0) out.append(static_cast<const char*>(tensor.data_ptr()), tensor.nbytes());
  return out;
}

StateDict parse_state_dict(const void* data, size_t size, const CheckpointReadOptions& options) {
  const auto* bytes = static_cast<const unsigned char*>(data);
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
  const std::string tmp = path + ".tmp";
  Fd file{::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644)};
  SWAPOPT_CHECK(file.fd >= 0, "[checkpoint] cannot create '" << tmp << "': " << std::strerror(errno));
  auto write_all = [&](const void* data, size_t size) {
    const char* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(file.fd, bytes, size);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : EIO;
        ::unlink(tmp.c_str());
        SWAPOPT_FAIL("[checkpoint] writing '" << tmp << "' failed: " << std::strerror(err));
      }
      bytes += n;
      size -= size_t(n);
    }
  };
  write_all(header.data(), header.size());
  for (const auto& [name, tensor] : state.tensors)
    if (tensor.nbytes() > 0) write_all(tensor.data_ptr(), tensor.nbytes());
  const bool synced = ::fsync(file.fd) == 0;
  const int closed = ::close(file.fd);
  file.fd = -1;
  if (!synced || closed != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    SWAPOPT_FAIL("[checkpoint] cannot commit '" << path << "': " << std::strerror(err));
  }
}

StateDict load_state_dict(const std::string& path, const CheckpointReadOptions& options) {
  // The header first, then each tensor read from the file into its own memory: no copy of the
  // whole file is ever held.
  Fd file{::open(path.c_str(), O_RDONLY)};
  SWAPOPT_CHECK(file.fd >= 0, "[checkpoint] cannot open '" << path << "': " << std::strerror(errno));
  struct stat info {};
  SWAPOPT_CHECK(::fstat(file.fd, &info) == 0, "[checkpoint] cannot stat '" << path << "': " << std::strerror(errno));
  const uint64_t size = uint64_t(info.st_size);
  auto read_at = [&](void* to, uint64_t n, uint64_t offset) {
    char* bytes = static_cast<char*>(to);
    while (n > 0) {
      const ssize_t got = ::pread(file.fd, bytes, size_t(std::min<uint64_t>(n, uint64_t(1) << 30)), off_t(offset));
      if (got < 0 && errno == EINTR) continue;
      SWAPOPT_CHECK(got > 0, "[checkpoint] reading '" << path << "' failed at byte " << offset << ": "
                                                     << (got < 0 ? std::strerror(errno) : "the file ended early"));
      bytes += got;
      n -= uint64_t(got);
      offset += uint64_t(got);
    }
  };
  SWAPOPT_CHECK(size >= 8, "[checkpoint] file of " << size << " bytes is too short for a safetensors header");
  unsigned char size_bytes[8];
  read_at(size_bytes, 8, 0);
  const uint64_t header_size = read_header_size(size_bytes, size);
  std::string text(size_t(header_size), '\0');
  read_at(text.data(), header_size, 8);
  const Header header = parse_header(text, size - 8 - header_size);
  const uint64_t payload = 8 + header_size;
  return read_tensors(header, options, [&](const TensorEntry& e, void* to) { read_at(to, e.end - e.begin, payload + e.begin); });
}

}  // namespace swapopt
