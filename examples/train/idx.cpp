#include "idx.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

namespace shmps::train {
namespace {

// Images larger than this are refused rather than allocated (Fashion-MNIST's
// training set is 47 M pixels).
constexpr uint64_t kMaxElements = uint64_t{1} << 31;
constexpr uint32_t kMaxSide = 4096;

std::string missing_file_message(const std::string& path) {
  return path +
         ": no such file (Fashion-MNIST is in Debian's package: "
         "apt-get install dataset-fashion-mnist; or pass --data-dir)";
}

struct GzCloser {
  void operator()(gzFile_s* file) const { gzclose(file); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

// An open IDX file (zlib reads gzip and plain files alike).
class IdxFile {
 public:
  static Result<IdxFile> open(const std::string& path) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return Status(ErrorCode::kIo, missing_file_message(path));
    IdxFile f;
    f.path_ = path;
    // O_NONBLOCK: a FIFO at the path must not block the open; a regular
    // file only (a FIFO or a device would block or never end the read).
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return Status(ErrorCode::kIo, path + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return Status(ErrorCode::kInvalidArgument, path + ": not a regular file");
    }
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    errno = 0;
    f.file_.reset(gzdopen(fd, "rb"));  // owns fd from here
    if (!f.file_) {
      ::close(fd);
      return Status(ErrorCode::kIo, path + ": cannot open: " + (errno != 0 ? std::strerror(errno) : "out of memory"));
    }
    gzbuffer(f.file_.get(), 1 << 17);
    return f;
  }

  // Reads exactly `n` bytes; kIo naming what was being read otherwise.
  Status read(void* out, size_t n, const char* what) {
    auto* dst = static_cast<unsigned char*>(out);
    size_t done = 0;
    while (done < n) {
      const auto chunk = static_cast<unsigned>(std::min<size_t>(n - done, size_t{1} << 30));
      const int got = gzread(file_.get(), dst + done, chunk);
      if (got < 0) {
        int zerr = 0;
        const char* msg = gzerror(file_.get(), &zerr);
        return Status(ErrorCode::kIo, path_ + ": corrupt data while reading " + what + ": " + msg);
      }
      if (got == 0) {
        return Status(ErrorCode::kIo, path_ + ": truncated: " + what + " ends after " + std::to_string(done) + " of " +
                                          std::to_string(n) + " bytes");
      }
      done += static_cast<size_t>(got);
    }
    return Status::Ok();
  }

  Result<uint32_t> read_be32(const char* what) {
    std::array<unsigned char, 4> b{};
    if (Status s = read(b.data(), b.size(), what); !s.ok()) return s;
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  }

  // Reads the magic and checks it.
  Status expect_magic(uint32_t magic, const char* kind) {
    Result<uint32_t> m = read_be32("the magic number");
    if (!m.ok()) return m.status();
    if (*m != magic) {
      char buf[96];
      std::snprintf(buf, sizeof buf, ": not an IDX %s file (magic 0x%08x, expected 0x%08x)", kind, *m, magic);
      return Status(ErrorCode::kInvalidArgument, path_ + buf);
    }
    return Status::Ok();
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  GzFile file_;
};

}  // namespace

Result<IdxImages> read_idx_images(const std::string& path, size_t limit) {
  Result<IdxFile> opened = IdxFile::open(path);
  if (!opened.ok()) return opened.status();
  IdxFile& f = *opened;
  if (Status s = f.expect_magic(kIdxImagesMagic, "image"); !s.ok()) return s;
  Result<uint32_t> count = f.read_be32("the image count");
  if (!count.ok()) return count.status();
  Result<uint32_t> rows = f.read_be32("the row count");
  if (!rows.ok()) return rows.status();
  Result<uint32_t> cols = f.read_be32("the column count");
  if (!cols.ok()) return cols.status();
  if (*rows == 0 || *cols == 0 || *rows > kMaxSide || *cols > kMaxSide) {
    return Status(ErrorCode::kInvalidArgument,
                  path + ": bad image size " + std::to_string(*rows) + "x" + std::to_string(*cols));
  }
  IdxImages images;
  images.file_count = *count;
  images.count = *count;
  if (limit > 0 && limit < images.count) images.count = static_cast<uint32_t>(limit);
  images.rows = *rows;
  images.cols = *cols;
  const uint64_t elements = uint64_t{images.count} * *rows * *cols;
  if (elements > kMaxElements) {
    return Status(ErrorCode::kInvalidArgument, path + ": " + std::to_string(*count) + " images of " +
                                                   std::to_string(*rows) + "x" + std::to_string(*cols) +
                                                   " is more than this reader accepts");
  }
  images.pixels.resize(elements);
  // Read in chunks and convert, so the raw bytes are never held whole.
  std::array<unsigned char, 1 << 16> raw{};
  for (uint64_t done = 0; done < elements;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(raw.size(), elements - done));
    if (Status s = f.read(raw.data(), n, "the pixel data"); !s.ok()) return s;
    float* out = images.pixels.data() + done;
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(raw[i]) * (1.0f / 255.0f);
    done += n;
  }
  return images;
}

Result<std::vector<uint8_t>> read_idx_labels(const std::string& path, size_t limit) {
  Result<IdxFile> opened = IdxFile::open(path);
  if (!opened.ok()) return opened.status();
  IdxFile& f = *opened;
  if (Status s = f.expect_magic(kIdxLabelsMagic, "label"); !s.ok()) return s;
  Result<uint32_t> count = f.read_be32("the label count");
  if (!count.ok()) return count.status();
  size_t n = *count;
  if (limit > 0 && limit < n) n = limit;
  if (n > kMaxElements) {
    return Status(ErrorCode::kInvalidArgument,
                  path + ": " + std::to_string(n) + " labels is more than this reader accepts");
  }
  std::vector<uint8_t> labels(n);
  if (Status s = f.read(labels.data(), n, "the label data"); !s.ok()) return s;
  for (size_t i = 0; i < n; ++i) {
    if (labels[i] >= kNumClasses) {
      return Status(ErrorCode::kInvalidArgument, path + ": label " + std::to_string(labels[i]) + " of example " +
                                                     std::to_string(i) + " is outside 0.." +
                                                     std::to_string(kNumClasses - 1));
    }
  }
  return labels;
}

Result<Dataset> load_idx_dataset(const std::string& images_path, const std::string& labels_path, size_t limit) {
  // Read all labels (they are small) so a count mismatch is caught even
  // when `limit` keeps only a prefix.
  Result<std::vector<uint8_t>> labels = read_idx_labels(labels_path);
  if (!labels.ok()) return labels.status();
  Result<IdxImages> images = read_idx_images(images_path, limit);
  if (!images.ok()) return images.status();
  if (images->file_count != labels->size()) {
    return Status(ErrorCode::kInvalidArgument, images_path + " has " + std::to_string(images->file_count) +
                                                   " images but " + labels_path + " has " +
                                                   std::to_string(labels->size()) + " labels");
  }
  const size_t kept = images->count;
  Dataset d;
  d.count = kept;
  d.features = size_t{images->rows} * images->cols;
  d.images = std::move(images->pixels);
  d.labels = std::move(*labels);
  d.labels.resize(kept);
  return d;
}

Result<Dataset> load_fashion_mnist(const std::string& dir, Split split, size_t limit) {
  const std::string prefix = dir + (split == Split::kTrain ? "/train" : "/t10k");
  auto pick = [](const std::string& base) {
    std::error_code ec;
    const std::string gz = base + ".gz";
    return std::filesystem::exists(gz, ec) || !std::filesystem::exists(base, ec) ? gz : base;
  };
  Result<Dataset> d = load_idx_dataset(pick(prefix + "-images-idx3-ubyte"), pick(prefix + "-labels-idx1-ubyte"), limit);
  if (!d.ok()) return d;
  if (d->count == 0) return Status(ErrorCode::kInvalidArgument, prefix + "-images-idx3-ubyte holds no images");
  if (d->features != 28 * 28) {
    return Status(ErrorCode::kInvalidArgument, prefix + "-images-idx3-ubyte: images have " +
                                                   std::to_string(d->features) +
                                                   " pixels, Fashion-MNIST's have 784 (28x28)");
  }
  return d;
}

Dataset take_shard(const Dataset& all, size_t index, size_t count) {
  Dataset d;
  d.features = all.features;
  for (size_t i = index; i < all.count; i += count) {
    d.images.insert(d.images.end(), all.images.begin() + static_cast<std::ptrdiff_t>(i * all.features),
                    all.images.begin() + static_cast<std::ptrdiff_t>((i + 1) * all.features));
    d.labels.push_back(all.labels[i]);
  }
  d.count = d.labels.size();
  return d;
}

}  // namespace shmps::train
