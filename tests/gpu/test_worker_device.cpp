// Worker::register_device_buffer where it can run without a GPU: the
// errors a caller sees. A library built without CUDA says so (kCuda,
// "built without CUDA"); one built with CUDA, on a host without the NVIDIA
// driver, says "no NVIDIA driver" (it loads libcuda.so.1 at run time), and
// without a device "no usable CUDA device"; with a device, a host pointer is
// refused as "not device memory". Argument checks hold everywhere.
#define BOOST_TEST_MODULE test_worker_device
#include <dlfcn.h>

#include <boost/test/unit_test.hpp>

#include <vector>

#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;

namespace {
using test::connect;
const std::vector<std::string> kArgs = {"--tensor", "w:256", "--backend", "host"};
}  // namespace

BOOST_AUTO_TEST_SUITE(worker_device)

BOOST_AUTO_TEST_CASE(null_or_empty_device_buffer_is_an_invalid_argument) {
  test::ServerProcess server(test::unique_name("devarg"), kArgs);
  auto w = connect(server.name());
  float x = 0;
  BOOST_TEST((w->register_device_buffer(nullptr, 1024).status().code() == ErrorCode::kInvalidArgument));
  BOOST_TEST((w->register_device_buffer(&x, 0).status().code() == ErrorCode::kInvalidArgument));
}

BOOST_AUTO_TEST_CASE(a_host_pointer_as_a_device_buffer_fails_with_a_clear_error) {
  test::ServerProcess server(test::unique_name("devhost"), kArgs);
  auto w = connect(server.name());
  std::vector<float> host(256, 1.0f);
  auto r = w->register_device_buffer(host.data(), host.size() * 4);
  BOOST_REQUIRE(!r.ok());
  const std::string m = r.status().message();
#if SHMPS_TEST_HAVE_CUDA
  // No driver: named with the library it could not load; a driver but no
  // device: that; with one: the pointer is host memory.
  void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) {
    BOOST_TEST((r.status().code() == ErrorCode::kCuda));
    BOOST_TEST(m.find("no NVIDIA driver in this process: libcuda.so.1 could not be loaded") != std::string::npos, m);
  } else if (r.status().code() == ErrorCode::kCuda) {
    BOOST_TEST(m.find("CUDA device") != std::string::npos, m);
  } else {
    BOOST_TEST((r.status().code() == ErrorCode::kInvalidArgument && m.find("not device memory") != std::string::npos),
               m);
  }
  if (driver != nullptr) ::dlclose(driver);
#else
  BOOST_TEST((r.status().code() == ErrorCode::kCuda));
  BOOST_TEST(m.find("built without CUDA") != std::string::npos, m);
#endif
  // Nothing was registered: the id space is untouched, the worker usable.
  auto buf = w->register_buffer(1024);
  BOOST_REQUIRE(buf.ok());
  BOOST_TEST(buf->id == 0u);
  BOOST_TEST(w->ping().ok());
}

BOOST_AUTO_TEST_CASE(pushing_a_host_buffer_ignores_the_stream) {
  test::ServerProcess server(test::unique_name("devstream"), kArgs);
  auto w = connect(server.name());
  auto buf = w->register_buffer(1024);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 256, 0.5f);
  int not_a_stream = 0;  // never dereferenced for a host buffer
  auto v = w->push(kAllTensors, buf->id, 0, 1024, Dtype::kF32, 0, &not_a_stream);
  BOOST_REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  BOOST_TEST(*v == 1u);
  BOOST_TEST(w->pull(kAllTensors, buf->id, 0, &not_a_stream).ok());
}

BOOST_AUTO_TEST_SUITE_END()
