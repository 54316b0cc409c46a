// The IDX reader on files the test writes itself, plain and gzipped: good
// data, a limit, truncation, a header claiming more than its file holds,
// wrong magic, zero or unexpected dimensions, labels out of range,
// image/label count mismatch and a missing file.
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <boost/test/unit_test.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "idx.hpp"
#include "test_support.hpp"

namespace fs = std::filesystem;
using namespace shmps::train;

namespace {

using Bytes = std::vector<uint8_t>;

// The error's stable name ("io", ...): printable when a check fails.
std::string_view code(const shmps::Status& s) { return shmps::error_code_name(s.code()); }
template <typename T>
std::string_view code(const shmps::Result<T>& r) {
  return code(r.status());
}

void put_be32(Bytes& b, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<uint8_t>(v >> shift));
}

Bytes images_file(uint32_t count, uint32_t rows, uint32_t cols, size_t pixel_bytes, uint32_t magic = kIdxImagesMagic) {
  Bytes b;
  put_be32(b, magic);
  put_be32(b, count);
  put_be32(b, rows);
  put_be32(b, cols);
  for (size_t i = 0; i < pixel_bytes; ++i) b.push_back(static_cast<uint8_t>(i * 37 % 256));
  return b;
}

Bytes labels_file(const Bytes& labels, uint32_t count, uint32_t magic = kIdxLabelsMagic) {
  Bytes b;
  put_be32(b, magic);
  put_be32(b, count);
  b.insert(b.end(), labels.begin(), labels.end());
  return b;
}

// A fresh folder per test case, removed afterwards.
struct TempDir {
  fs::path dir = fs::temp_directory_path() / shmps::test::unique_name("shmps_idx");
  TempDir() { fs::create_directories(dir); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }

  // Writes `bytes` to dir/name, gzipped when name ends in ".gz".
  std::string write(const std::string& name, const Bytes& bytes) const {
    const std::string path = (dir / name).string();
    if (name.ends_with(".gz")) {
      gzFile f = gzopen(path.c_str(), "wb");
      BOOST_REQUIRE(f != nullptr);
      if (!bytes.empty())
        BOOST_REQUIRE_EQUAL(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
                            static_cast<int>(bytes.size()));
      BOOST_REQUIRE_EQUAL(gzclose(f), Z_OK);
    } else {
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
      BOOST_REQUIRE(f.good());
    }
    return path;
  }
};

const char* const kSuffixes[] = {"", ".gz"};

}  // namespace

BOOST_AUTO_TEST_SUITE(idx)

BOOST_FIXTURE_TEST_CASE(reads_good_files_plain_and_gzipped, TempDir) {
  for (const char* sfx : kSuffixes) {
    BOOST_TEST_CONTEXT("suffix '" << sfx << "'") {
      const std::string img = write(std::string("img") + sfx, images_file(3, 2, 4, 3 * 2 * 4));
      const std::string lab = write(std::string("lab") + sfx, labels_file({7, 0, 9}, 3));
      shmps::Result<Dataset> d = load_idx_dataset(img, lab);
      BOOST_REQUIRE_MESSAGE(d.ok(), d.status().to_string());
      BOOST_TEST(d->count == 3u);
      BOOST_TEST(d->features == 8u);
      BOOST_TEST(d->labels == (std::vector<uint8_t>{7, 0, 9}), boost::test_tools::per_element());
      BOOST_REQUIRE_EQUAL(d->images.size(), 24u);
      for (size_t i = 0; i < 24; ++i) {
        BOOST_TEST(d->images[i] == static_cast<float>(i * 37 % 256) / 255.0f, boost::test_tools::tolerance(1e-6f));
      }
      shmps::Result<IdxImages> raw = read_idx_images(img);
      BOOST_REQUIRE(raw.ok());
      BOOST_TEST(raw->rows == 2u);
      BOOST_TEST(raw->cols == 4u);
      BOOST_TEST(raw->file_count == 3u);
    }
  }
}

BOOST_FIXTURE_TEST_CASE(limit_keeps_a_prefix, TempDir) {
  const std::string img = write("img.gz", images_file(3, 2, 2, 12));
  const std::string lab = write("lab.gz", labels_file({1, 2, 3}, 3));
  shmps::Result<Dataset> d = load_idx_dataset(img, lab, 2);
  BOOST_REQUIRE_MESSAGE(d.ok(), d.status().to_string());
  BOOST_TEST(d->count == 2u);
  BOOST_TEST(d->images.size() == 8u);
  BOOST_TEST(d->labels == (std::vector<uint8_t>{1, 2}), boost::test_tools::per_element());
  // A limit above the count keeps everything.
  shmps::Result<Dataset> all = load_idx_dataset(img, lab, 100);
  BOOST_REQUIRE(all.ok());
  BOOST_TEST(all->count == 3u);
}

BOOST_FIXTURE_TEST_CASE(truncated_files_are_refused, TempDir) {
  for (const char* sfx : kSuffixes) {
    BOOST_TEST_CONTEXT("suffix '" << sfx << "'") {
      // Pixel data one byte short.
      const std::string img = write(std::string("img") + sfx, images_file(3, 2, 2, 11));
      shmps::Result<IdxImages> r = read_idx_images(img);
      BOOST_REQUIRE(!r.ok());
      BOOST_TEST(code(r) == "io");
      BOOST_TEST(r.status().message().find("truncated") != std::string::npos, r.status().message());
      BOOST_TEST(r.status().message().find(img) != std::string::npos, r.status().message());
      // Header cut short.
      Bytes header = images_file(3, 2, 2, 0);
      header.resize(10);
      const std::string short_img = write(std::string("short") + sfx, header);
      BOOST_TEST(code(read_idx_images(short_img)) == "io");
      // Labels two short.
      const std::string lab = write(std::string("lab") + sfx, labels_file({1, 2}, 4));
      shmps::Result<std::vector<uint8_t>> l = read_idx_labels(lab);
      BOOST_REQUIRE(!l.ok());
      BOOST_TEST(l.status().message().find("truncated") != std::string::npos, l.status().message());
      // An empty file.
      const std::string empty = write(std::string("empty") + sfx, {});
      BOOST_TEST(code(read_idx_labels(empty)) == "io");
    }
  }
}

// A header claiming far more than the file holds: a plain file is measured
// against the claim before anything is allocated for it (the whole claim,
// also under a limit), a gzip file fails where its data ends; the image
// size is checked on the header.
BOOST_FIXTURE_TEST_CASE(a_header_claiming_more_than_the_file_holds_is_refused, TempDir) {
  const std::string img = write("img", images_file(100000, 28, 28, 100));
  for (const size_t limit : {size_t{0}, size_t{1}}) {
    shmps::Result<IdxImages> r = read_idx_images(img, limit);
    BOOST_REQUIRE(!r.ok());
    BOOST_TEST(code(r) == "io");
    BOOST_TEST(r.status().message() == img +
                                           ": truncated: the header claims 100000 images of 28x28 (78400000 bytes "
                                           "of data), the file holds 100");
  }
  const std::string lab = write("lab", labels_file({1, 2}, 1000000));
  shmps::Result<std::vector<uint8_t>> l = read_idx_labels(lab);
  BOOST_REQUIRE(!l.ok());
  BOOST_TEST(code(l) == "io");
  BOOST_TEST(l.status().message() ==
             lab + ": truncated: the header claims 1000000 labels (1000000 bytes of data), the file holds 2");
  const std::string gz = write("img.gz", images_file(100000, 28, 28, 100));
  shmps::Result<IdxImages> g = read_idx_images(gz);
  BOOST_REQUIRE(!g.ok());
  BOOST_TEST(g.status().message() == gz + ": truncated: the pixel data ends after 100 of 78400000 bytes");
  const std::string lab_gz = write("lab.gz", labels_file({1, 2}, 1000000));
  BOOST_TEST(read_idx_labels(lab_gz).status().message() ==
             lab_gz + ": truncated: the label data ends after 2 of 1000000 bytes");
  const std::string small = write("small", images_file(1, 2, 2, 4));
  shmps::Result<IdxImages> s = read_idx_images(small, 0, 28, 28);
  BOOST_REQUIRE(!s.ok());
  BOOST_TEST(code(s) == "invalid_argument");
  BOOST_TEST(s.status().message() == small + ": images of 2x2, expected 28x28 (784 pixels)");
}

BOOST_FIXTURE_TEST_CASE(cut_gzip_stream_is_refused, TempDir) {
  const std::string good = write("img.gz", images_file(50, 28, 28, 50 * 28 * 28));
  // Keep the first half of the compressed bytes.
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = (dir / "cut.gz").string();
  std::ofstream(cut, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  shmps::Result<IdxImages> r = read_idx_images(cut);
  BOOST_REQUIRE(!r.ok());
  BOOST_TEST(code(r) == "io");
  BOOST_TEST(r.status().message().find(cut) != std::string::npos, r.status().message());
}

BOOST_FIXTURE_TEST_CASE(wrong_magic_is_refused, TempDir) {
  for (const char* sfx : kSuffixes) {
    BOOST_TEST_CONTEXT("suffix '" << sfx << "'") {
      const std::string img = write(std::string("img") + sfx, images_file(1, 2, 2, 4));
      const std::string lab = write(std::string("lab") + sfx, labels_file({1}, 1));
      // Each file read as the other kind.
      shmps::Result<IdxImages> r = read_idx_images(lab);
      BOOST_REQUIRE(!r.ok());
      BOOST_TEST(code(r) == "invalid_argument");
      BOOST_TEST(r.status().message().find("magic 0x00000801") != std::string::npos, r.status().message());
      BOOST_TEST(r.status().message().find(lab) != std::string::npos, r.status().message());
      BOOST_TEST(code(read_idx_labels(img)) == "invalid_argument");
      // A 4-byte float IDX file (type 0x0d).
      const std::string f32 = write(std::string("f32") + sfx, images_file(1, 2, 2, 16, 0x00000D03));
      BOOST_TEST(code(read_idx_images(f32)) == "invalid_argument");
    }
  }
}

BOOST_FIXTURE_TEST_CASE(zero_dimensions_are_refused, TempDir) {
  const std::string img = write("img", images_file(1, 0, 28, 0));
  shmps::Result<IdxImages> r = read_idx_images(img);
  BOOST_REQUIRE(!r.ok());
  BOOST_TEST(code(r) == "invalid_argument");
  BOOST_TEST(r.status().message().find("0x28") != std::string::npos, r.status().message());
}

BOOST_FIXTURE_TEST_CASE(label_out_of_range_is_refused, TempDir) {
  for (const char* sfx : kSuffixes) {
    BOOST_TEST_CONTEXT("suffix '" << sfx << "'") {
      const std::string lab = write(std::string("lab") + sfx, labels_file({0, 9, 10, 1}, 4));
      shmps::Result<std::vector<uint8_t>> r = read_idx_labels(lab);
      BOOST_REQUIRE(!r.ok());
      BOOST_TEST(code(r) == "invalid_argument");
      BOOST_TEST(r.status().message().find("label 10 of example 2") != std::string::npos, r.status().message());
    }
  }
}

BOOST_FIXTURE_TEST_CASE(count_mismatch_is_refused, TempDir) {
  for (const char* sfx : kSuffixes) {
    BOOST_TEST_CONTEXT("suffix '" << sfx << "'") {
      const std::string img = write(std::string("img") + sfx, images_file(3, 2, 2, 12));
      const std::string lab = write(std::string("lab") + sfx, labels_file({1, 2, 3, 4}, 4));
      shmps::Result<Dataset> d = load_idx_dataset(img, lab);
      BOOST_REQUIRE(!d.ok());
      BOOST_TEST(code(d) == "invalid_argument");
      BOOST_TEST(d.status().message().find("3 images") != std::string::npos, d.status().message());
      BOOST_TEST(d.status().message().find("4 labels") != std::string::npos, d.status().message());
      // A limit does not hide the mismatch.
      BOOST_TEST(!load_idx_dataset(img, lab, 2).ok());
    }
  }
}

BOOST_FIXTURE_TEST_CASE(missing_file_names_the_package, TempDir) {
  const std::string path = (dir / "nope-images-idx3-ubyte.gz").string();
  shmps::Result<IdxImages> r = read_idx_images(path);
  BOOST_REQUIRE(!r.ok());
  BOOST_TEST(code(r) == "io");
  BOOST_TEST(r.status().message().find(path) != std::string::npos, r.status().message());
  BOOST_TEST(r.status().message().find("apt-get install dataset-fashion-mnist") != std::string::npos,
             r.status().message());
  shmps::Result<Dataset> d = load_fashion_mnist(dir.string(), Split::kTest);
  BOOST_REQUIRE(!d.ok());
  BOOST_TEST(d.status().message().find("t10k") != std::string::npos, d.status().message());
}

BOOST_FIXTURE_TEST_CASE(fashion_mnist_layout_plain_files, TempDir) {
  // load_fashion_mnist takes the plain name when no .gz is there, and
  // wants 28x28 images.
  write("t10k-images-idx3-ubyte", images_file(2, 28, 28, 2 * 784));
  write("t10k-labels-idx1-ubyte", labels_file({3, 4}, 2));
  shmps::Result<Dataset> d = load_fashion_mnist(dir.string(), Split::kTest);
  BOOST_REQUIRE_MESSAGE(d.ok(), d.status().to_string());
  BOOST_TEST(d->count == 2u);
  write("train-images-idx3-ubyte.gz", images_file(2, 2, 2, 8));
  write("train-labels-idx1-ubyte.gz", labels_file({3, 4}, 2));
  shmps::Result<Dataset> wrong = load_fashion_mnist(dir.string(), Split::kTrain);
  BOOST_REQUIRE(!wrong.ok());
  BOOST_TEST(wrong.status().message().find("784") != std::string::npos, wrong.status().message());
}

// A FIFO (or a device) at a dataset's path is refused at once: reading it
// would block, or never end. A set of 0 images trains nothing and scores
// nothing: refused too.
BOOST_FIXTURE_TEST_CASE(a_fifo_or_an_empty_set_is_refused, TempDir) {
  const std::string fifo = (dir / "t10k-images-idx3-ubyte").string();
  BOOST_REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  write("t10k-labels-idx1-ubyte", labels_file({3, 4}, 2));
  shmps::Result<Dataset> d = load_fashion_mnist(dir.string(), Split::kTest);
  BOOST_REQUIRE(!d.ok());
  BOOST_TEST(d.status().message() == fifo + ": not a regular file");
  fs::remove(fifo);
  write("t10k-images-idx3-ubyte", images_file(0, 28, 28, 0));
  write("t10k-labels-idx1-ubyte", labels_file({}, 0));
  shmps::Result<Dataset> empty = load_fashion_mnist(dir.string(), Split::kTest);
  BOOST_REQUIRE(!empty.ok());
  BOOST_TEST(empty.status().message() == (dir / "t10k").string() + "-images-idx3-ubyte holds no images");
}

BOOST_AUTO_TEST_CASE(a_shard_takes_every_nth_image_from_its_index) {
  Dataset all;
  all.features = 2;
  all.count = 7;
  for (size_t i = 0; i < 7; ++i) {
    all.images.insert(all.images.end(), {static_cast<float>(i), static_cast<float>(10 * i)});
    all.labels.push_back(static_cast<uint8_t>(i));
  }
  const Dataset s = take_shard(all, 1, 3);  // images 1 and 4
  BOOST_TEST(s.count == 2u);
  BOOST_TEST(s.features == 2u);
  BOOST_TEST(s.labels == (std::vector<uint8_t>{1, 4}), boost::test_tools::per_element());
  BOOST_TEST(s.images == (std::vector<float>{1, 10, 4, 40}), boost::test_tools::per_element());
  BOOST_TEST(take_shard(all, 0, 1).images == all.images, boost::test_tools::per_element());
}

BOOST_AUTO_TEST_CASE(real_fashion_mnist_when_installed,
                     *boost::unit_test::precondition([](boost::unit_test::test_unit_id) {
                       return boost::test_tools::assertion_result(
                           fs::exists(std::string(kDefaultFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz"));
                     })) {
  shmps::Result<Dataset> test = load_fashion_mnist(kDefaultFashionMnistDir, Split::kTest);
  BOOST_REQUIRE_MESSAGE(test.ok(), test.status().to_string());
  BOOST_TEST(test->count == 10000u);
  BOOST_TEST(test->features == 784u);
  std::vector<size_t> per_class(kNumClasses);
  for (uint8_t l : test->labels) ++per_class[l];
  for (size_t c : per_class) BOOST_TEST(c == 1000u);  // the test set is balanced
  const auto [lo, hi] = std::minmax_element(test->images.begin(), test->images.end());
  BOOST_TEST(*lo == 0.0f);
  BOOST_TEST(*hi == 1.0f);
  shmps::Result<Dataset> train = load_fashion_mnist(kDefaultFashionMnistDir, Split::kTrain, 1000);
  BOOST_REQUIRE_MESSAGE(train.ok(), train.status().to_string());
  BOOST_TEST(train->count == 1000u);
}

BOOST_AUTO_TEST_SUITE_END()
