// Reader for the IDX files of (Fashion-)MNIST, gzipped or plain, into float
// pixels in [0, 1] and uint8 labels. Every function is a pure function of
// its files: safe to call from any thread; results are plain values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shmps/status.hpp"

namespace shmps::train {

inline constexpr uint32_t kIdxImagesMagic = 0x00000803;  // uint8, 3 dims
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // uint8, 1 dim
inline constexpr uint32_t kNumClasses = 10;
inline constexpr uint32_t kFashionMnistSide = 28;  // images of 28 x 28

// Where Debian's dataset-fashion-mnist installs the four files.
inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct IdxImages {
  uint32_t count = 0;       // images read (at most the limit)
  uint32_t file_count = 0;  // images the header announces
  uint32_t rows = 0;
  uint32_t cols = 0;
  std::vector<float> pixels;  // count x rows x cols, row-major, value/255
};

// Images and their labels, example i at images[i*features ..).
struct Dataset {
  size_t count = 0;
  size_t features = 0;  // rows * cols
  std::vector<float> images;
  std::vector<uint8_t> labels;  // each < kNumClasses
};

// Reads an IDX3 uint8 image file (gzip or plain: zlib reads both).
// `limit` > 0 keeps only the first `limit` images (the rest is not read).
// `want_rows`, `want_cols` > 0: the images must be that size (checked on
// the header). Memory follows the data, not the header's count: a plain
// file must be as long as its header claims (checked before anything is
// allocated), and a gzip file's pixels are gathered as they arrive.
// Errors (the message names the file): kIo for a missing/unreadable file
// (mentions `apt-get install dataset-fashion-mnist`) or truncated data
// (for a plain file: "the header claims N images of RxC"),
// kInvalidArgument for a wrong magic, zero, oversized or unexpected
// dimensions.
Result<IdxImages> read_idx_images(const std::string& path, size_t limit = 0, uint32_t want_rows = 0,
                                  uint32_t want_cols = 0);

// Reads an IDX1 uint8 label file; every label must be < kNumClasses.
// Errors as read_idx_images, plus kInvalidArgument for a label out of range.
Result<std::vector<uint8_t>> read_idx_labels(const std::string& path, size_t limit = 0);

// Reads an image file and its label file; their counts must match
// (kInvalidArgument otherwise, both files and counts in the message).
// `want_rows`, `want_cols`: as read_idx_images().
Result<Dataset> load_idx_dataset(const std::string& images_path, const std::string& labels_path, size_t limit = 0,
                                 uint32_t want_rows = 0, uint32_t want_cols = 0);

enum class Split { kTrain, kTest };

// Loads <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (the .gz
// name first); the images must be 28x28 (checked before they are read).
Result<Dataset> load_fashion_mnist(const std::string& dir, Split split, size_t limit = 0);

// Images index, index + count, index + 2 count, ... of `all` (a host's
// share of the data when several hosts train one job); index < count.
Dataset take_shard(const Dataset& all, size_t index, size_t count);

}  // namespace shmps::train
