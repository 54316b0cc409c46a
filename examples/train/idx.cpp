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

// More images or labels than this are refused rather than read (1 GiB of
// float pixels; Fashion-MNIST's training set is 47 M pixels).
constexpr uint64_t kMaxElements = uint64_t{1} << 28;
constexpr uint32_t kMaxSide = 4096;
// Bytes per read: the step by which a gzip file's data is gathered.
constexpr size_t kChunk = size_t{1} << 16;

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
    f.file_size_ = static_cast<uint64_t>(st.st_size);
    return f;
  }

  // Reads exactly `n` bytes; kIo naming what was being read otherwise.
  // `before` and `whole`: where these bytes lie within `what` (for the
  // message of a read in chunks).
  Status read(void* out, size_t n, const char* what, uint64_t before = 0, uint64_t whole = 0) {
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
        return Status(ErrorCode::kIo, path_ + ": truncated: " + what + " ends after " + std::to_string(before + done) +
                                          " of " + std::to_string(whole != 0 ? whole : n) + " bytes");
      }
      done += static_cast<size_t>(got);
      consumed_ += static_cast<uint64_t>(got);
    }
    return Status::Ok();
  }

  // For a plain file, kIo when it holds fewer than `n` bytes after those
  // read so far (`claim` says what the header claims): checked before
  // anything is allocated for them. A gzip file's size says nothing about
  // its data's: read_growing() gathers those. Call after a read.
  Status expect_plain_bytes(uint64_t n, const std::string& claim) const {
    if (!plain()) return Status::Ok();
    const uint64_t left = file_size_ > consumed_ ? file_size_ - consumed_ : 0;
    if (n <= left) return Status::Ok();
    return Status(ErrorCode::kIo, path_ + ": truncated: the header claims " + claim + " (" + std::to_string(n) +
                                      " bytes of data), the file holds " + std::to_string(left));
  }

  // Reads exactly `n` bytes into a buffer that grows with the data as it
  // arrives, so that a header's count alone allocates nothing (a short
  // gzip file claiming millions of images fails on its data, not on
  // memory); kIo as read().
  Result<std::vector<uint8_t>> read_growing(uint64_t n, const char* what) {
    std::vector<uint8_t> out;
    for (uint64_t done = 0; done < n;) {
      const size_t step = static_cast<size_t>(std::min<uint64_t>(kChunk, n - done));
      if (done + step > out.capacity())
        out.reserve(static_cast<size_t>(std::min<uint64_t>(n, std::max<uint64_t>(2 * out.capacity(), done + step))));
      out.resize(static_cast<size_t>(done + step));
      if (Status s = read(out.data() + done, step, what, done, n); !s.ok()) return s;
      done += step;
    }
    return out;
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
  // Whether the file is plain rather than gzip (zlib knows after a read).
  bool plain() const { return gzdirect(file_.get()) != 0; }

 private:
  std::string path_;
  GzFile file_;
  uint64_t file_size_ = 0;  // st_size at open
  uint64_t consumed_ = 0;   // bytes read()
};

}  // namespace

Result<IdxImages> read_idx_images(const std::string& path, size_t limit, uint32_t want_rows, uint32_t want_cols) {
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
  if ((want_rows != 0 && *rows != want_rows) || (want_cols != 0 && *cols != want_cols)) {
    return Status(ErrorCode::kInvalidArgument, path + ": images of " + std::to_string(*rows) + "x" +
                                                   std::to_string(*cols) + ", expected " + std::to_string(want_rows) +
                                                   "x" + std::to_string(want_cols) + " (" +
                                                   std::to_string(uint64_t{want_rows} * want_cols) + " pixels)");
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
  // Nothing is allocated on the header's word: a plain file must hold every
  // image it claims, and a gzip file's bytes are gathered as they arrive.
  const std::string claim =
      std::to_string(*count) + " images of " + std::to_string(*rows) + "x" + std::to_string(*cols);
  if (Status s = f.expect_plain_bytes(uint64_t{*count} * *rows * *cols, claim); !s.ok()) return s;
  const auto to_float = [](const uint8_t* raw, size_t n, float* out) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(raw[i]) * (1.0f / 255.0f);
  };
  if (f.plain()) {
    images.pixels.resize(elements);
    // Read in chunks and convert, so the raw bytes are never held whole.
    std::array<uint8_t, kChunk> raw{};
    for (uint64_t done = 0; done < elements;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(raw.size(), elements - done));
      if (Status s = f.read(raw.data(), n, "the pixel data", done, elements); !s.ok()) return s;
      to_float(raw.data(), n, images.pixels.data() + done);
      done += n;
    }
    return images;
  }
  Result<std::vector<uint8_t>> raw = f.read_growing(elements, "the pixel data");
  if (!raw.ok()) return raw.status();
  images.pixels.resize(elements);
  to_float(raw->data(), raw->size(), images.pixels.data());
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
  if (Status s = f.expect_plain_bytes(*count, std::to_string(*count) + " labels"); !s.ok()) return s;
  Result<std::vector<uint8_t>> read = f.read_growing(n, "the label data");
  if (!read.ok()) return read.status();
  std::vector<uint8_t> labels = std::move(*read);
  for (size_t i = 0; i < n; ++i) {
    if (labels[i] >= kNumClasses) {
      return Status(ErrorCode::kInvalidArgument, path + ": label " + std::to_string(labels[i]) + " of example " +
                                                     std::to_string(i) + " is outside 0.." +
                                                     std::to_string(kNumClasses - 1));
    }
  }
  return labels;
}

Result<Dataset> load_idx_dataset(const std::string& images_path, const std::string& labels_path, size_t limit,
                                 uint32_t want_rows, uint32_t want_cols) {
  // Read all labels (they are small) so a count mismatch is caught even
  // when `limit` keeps only a prefix.
  Result<std::vector<uint8_t>> labels = read_idx_labels(labels_path);
  if (!labels.ok()) return labels.status();
  Result<IdxImages> images = read_idx_images(images_path, limit, want_rows, want_cols);
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
  // 28x28 checked from the header, before the pixels are read.
  Result<Dataset> d = load_idx_dataset(pick(prefix + "-images-idx3-ubyte"), pick(prefix + "-labels-idx1-ubyte"), limit,
                                       kFashionMnistSide, kFashionMnistSide);
  if (!d.ok()) return d;
  if (d->count == 0) return Status(ErrorCode::kInvalidArgument, prefix + "-images-idx3-ubyte holds no images");
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
