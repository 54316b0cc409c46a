#include "checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/crc.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <type_traits>

namespace shmps::server {
namespace {

struct CheckpointHeader {
  uint64_t magic;
  uint32_t format;
  uint32_t header_size;
  uint64_t version;
  uint32_t optimizer_kind;
  uint32_t state_arrays;
  uint32_t tensor_count;
  uint32_t reserved0;
  uint64_t total_elements;
  uint64_t reserved[2];
};
static_assert(sizeof(CheckpointHeader) == 64 && std::is_trivially_copyable_v<CheckpointHeader>);

struct CheckpointTensor {
  char name[shm::kNameBytes];
  uint32_t ndim;
  uint32_t reserved0;
  uint64_t shape[shm::kMaxDims];
  uint64_t step;
};
static_assert(sizeof(CheckpointTensor) == 112 && std::is_trivially_copyable_v<CheckpointTensor>);

std::string errno_text() { return std::strerror(errno); }

std::string file_name(uint64_t version) {
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%020llu.shmps", static_cast<unsigned long long>(version));
  return name;
}

bool is_checkpoint_name(const std::string& n) {
  return n.size() == 5 + 20 + 6 && n.rfind("ckpt-", 0) == 0 && n.compare(25, 6, ".shmps") == 0 &&
         n.find_first_not_of("0123456789", 5) == 25;
}

// write(2) all of it; false with errno set on failure.
bool write_all(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

Status write_checkpoint(const std::string& dir, const CheckpointData& data) {
  const uint64_t total = data.weights.size();
  if (data.state.size() != uint64_t{data.state_arrays} * total || data.steps.size() != data.tensors.size())
    return {ErrorCode::kInternal, "inconsistent checkpoint snapshot"};
  CheckpointHeader h{};
  h.magic = kCheckpointMagic;
  h.format = kCheckpointFormat;
  h.header_size = sizeof h;
  h.version = data.version;
  h.optimizer_kind = data.optimizer_kind;
  h.state_arrays = data.state_arrays;
  h.tensor_count = static_cast<uint32_t>(data.tensors.size());
  h.total_elements = total;
  std::vector<CheckpointTensor> tensors(data.tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    CheckpointTensor& t = tensors[i];
    std::memset(&t, 0, sizeof t);
    std::snprintf(t.name, sizeof t.name, "%s", data.tensors[i].name.c_str());
    t.ndim = static_cast<uint32_t>(data.tensors[i].shape.size());
    std::copy(data.tensors[i].shape.begin(), data.tensors[i].shape.end(), t.shape);
    t.step = data.steps[i];
  }
  boost::crc_32_type crc;
  crc.process_bytes(&h, sizeof h);
  crc.process_bytes(tensors.data(), tensors.size() * sizeof(CheckpointTensor));
  crc.process_bytes(data.weights.data(), data.weights.size() * sizeof(float));
  crc.process_bytes(data.state.data(), data.state.size() * sizeof(float));
  const uint32_t checksum = crc.checksum();

  const std::string final_path = dir + "/" + file_name(data.version);
  const std::string temp_path = dir + "/." + file_name(data.version) + ".tmp";
  const int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return {ErrorCode::kIo, "checkpoint: open " + temp_path + ": " + errno_text()};
  const bool ok = write_all(fd, &h, sizeof h) &&
                  write_all(fd, tensors.data(), tensors.size() * sizeof(CheckpointTensor)) &&
                  write_all(fd, data.weights.data(), data.weights.size() * sizeof(float)) &&
                  write_all(fd, data.state.data(), data.state.size() * sizeof(float)) &&
                  write_all(fd, &checksum, sizeof checksum) && ::fsync(fd) == 0;
  const std::string write_error = ok ? "" : errno_text();
  ::close(fd);
  if (!ok) {
    ::unlink(temp_path.c_str());
    return {ErrorCode::kIo, "checkpoint: write " + temp_path + ": " + write_error};
  }
  if (::rename(temp_path.c_str(), final_path.c_str()) != 0) {
    const std::string err = errno_text();
    ::unlink(temp_path.c_str());
    return {ErrorCode::kIo, "checkpoint: rename to " + final_path + ": " + err};
  }
  // The rename is durable only once the directory is.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || ::fsync(dfd) != 0) {
    const std::string err = errno_text();
    if (dfd >= 0) ::close(dfd);
    return {ErrorCode::kIo, "checkpoint: fsync " + dir + ": " + err};
  }
  ::close(dfd);
  return Status::Ok();
}

Result<CheckpointData> read_checkpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return Status{ErrorCode::kIo, path + ": cannot open"};
  const auto size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  const auto corrupt = [&](const std::string& why) { return Status{ErrorCode::kLayoutMismatch, path + ": " + why}; };
  CheckpointHeader h{};
  if (size < sizeof h + 4 || !in.read(reinterpret_cast<char*>(&h), sizeof h)) return corrupt("truncated header");
  if (h.magic != kCheckpointMagic) return corrupt("not a shmps checkpoint (bad magic)");
  if (h.format != kCheckpointFormat)
    return corrupt("checkpoint format " + std::to_string(h.format) + ", this build reads " + std::to_string(kCheckpointFormat));
  if (h.header_size != sizeof h || h.tensor_count == 0 || h.tensor_count > shm::kMaxTensorsLimit || h.state_arrays > 3)
    return corrupt("implausible header");
  // Size check before any allocation: the counts come from the file.
  uint64_t expected = 0;
  const uint64_t floats = h.total_elements * (uint64_t{1} + h.state_arrays);
  if (h.total_elements > (uint64_t{1} << 40) ||
      __builtin_add_overflow(sizeof h + uint64_t{h.tensor_count} * sizeof(CheckpointTensor), floats * 4 + 4, &expected) ||
      expected != size)
    return corrupt("size " + std::to_string(size) + " does not match its header (truncated?)");
  std::vector<CheckpointTensor> tensors(h.tensor_count);
  CheckpointData data;
  data.version = h.version;
  data.optimizer_kind = h.optimizer_kind;
  data.state_arrays = h.state_arrays;
  data.weights.resize(h.total_elements);
  data.state.resize(h.total_elements * h.state_arrays);
  uint32_t stored = 0;
  if (!in.read(reinterpret_cast<char*>(tensors.data()), static_cast<std::streamsize>(tensors.size() * sizeof(CheckpointTensor))) ||
      !in.read(reinterpret_cast<char*>(data.weights.data()), static_cast<std::streamsize>(data.weights.size() * 4)) ||
      !in.read(reinterpret_cast<char*>(data.state.data()), static_cast<std::streamsize>(data.state.size() * 4)) ||
      !in.read(reinterpret_cast<char*>(&stored), 4))
    return corrupt("truncated");
  boost::crc_32_type crc;
  crc.process_bytes(&h, sizeof h);
  crc.process_bytes(tensors.data(), tensors.size() * sizeof(CheckpointTensor));
  crc.process_bytes(data.weights.data(), data.weights.size() * 4);
  crc.process_bytes(data.state.data(), data.state.size() * 4);
  if (crc.checksum() != stored) return corrupt("checksum mismatch");
  uint64_t sum = 0;
  for (const CheckpointTensor& t : tensors) {
    if (std::memchr(t.name, '\0', sizeof t.name) == nullptr || t.ndim == 0 || t.ndim > shm::kMaxDims)
      return corrupt("bad tensor record");
    shm::TensorSpec spec;
    spec.name = t.name;
    spec.shape.assign(t.shape, t.shape + t.ndim);
    uint64_t count = 1;
    for (uint64_t d : spec.shape)
      if (d == 0 || __builtin_mul_overflow(count, d, &count)) return corrupt("bad tensor shape");
    sum += count;
    data.tensors.push_back(std::move(spec));
    data.steps.push_back(t.step);
  }
  if (sum != h.total_elements) return corrupt("tensor shapes do not add up to total_elements");
  return data;
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (is_checkpoint_name(e->d_name)) names.emplace_back(e->d_name);
    ::closedir(d);
  }
  // Fixed-width versions: name order is version order.
  std::sort(names.rbegin(), names.rend());
  for (std::string& n : names) n = dir + "/" + n;
  return names;
}

void prune_checkpoints(const std::string& dir, uint32_t keep) {
  const std::vector<std::string> all = list_checkpoints(dir);
  for (size_t i = std::max<size_t>(keep, 1); i < all.size(); ++i) ::unlink(all[i].c_str());
}

CheckpointWriter::CheckpointWriter(std::string dir, uint32_t keep)
    : dir_(std::move(dir)), keep_(keep), thread_([this] { loop(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::lock_guard lock(mutex_);
    quit_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool CheckpointWriter::submit(CheckpointData data) {
  {
    std::lock_guard lock(mutex_);
    if (has_job_ || writing_) return false;
    job_ = std::move(data);
    has_job_ = true;
  }
  cv_.notify_all();
  return true;
}

Status CheckpointWriter::drain() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return !has_job_ && !writing_; });
  Status s = result_;
  result_ = Status::Ok();
  return s;
}

Status CheckpointWriter::take_result() {
  std::lock_guard lock(mutex_);
  Status s = result_;
  result_ = Status::Ok();
  return s;
}

bool CheckpointWriter::busy() const {
  std::lock_guard lock(mutex_);
  return has_job_ || writing_;
}

void CheckpointWriter::loop() {
  std::unique_lock lock(mutex_);
  while (true) {
    cv_.wait(lock, [&] { return quit_ || has_job_; });
    if (!has_job_) return;  // quit with nothing pending
    CheckpointData job = std::move(job_);
    has_job_ = false;
    writing_ = true;
    lock.unlock();
    Status s = write_checkpoint(dir_, job);
    if (s.ok()) prune_checkpoints(dir_, keep_);
    lock.lock();
    writing_ = false;
    if (!s.ok()) result_ = s;
    cv_.notify_all();
  }
}

}  // namespace shmps::server
