// The server's handle cache on the host backend, with POSIX shm objects
// standing in for CUDA allocations (the CUDA twins are in tests/gpu): a
// buffer is opened once at registration and never during pushes; every
// open is closed again and no mapping is left behind; a recreated object
// of the same name (the "recycled address") gets a fresh mapping, never
// the old one. Server and workers run in this process, so /proc/self/maps
// shows every mapping of both.
#define BOOST_TEST_MODULE test_handle_cache
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <fstream>
#include <thread>

#include "raw_client.hpp"
#include "server_support.hpp"
#include "shmps/server/server.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace shmps::server;

namespace {

ServerConfig cache_config(const std::string& tag) {
  ServerConfig config;
  config.name = test::unique_name(tag);
  config.tensors = {{"w", {4}}};
  config.optimizer.lr = 1.0f;
  config.max_staleness = 1u << 30;
  config.backend = BackendKind::kHost;
  return config;
}

// A server run in this process, and a read-only view of its statistics.
struct CacheServer : test::InProcessServer {
  explicit CacheServer(const std::string& tag) : CacheServer(cache_config(tag)) {}
  explicit CacheServer(const ServerConfig& c) : test::InProcessServer(c), config(c) {
    auto seg = shm::Segment::open(config.name, /*read_only=*/true);
    BOOST_REQUIRE(seg.ok());
    view = std::move(seg).value();
  }
  // relaxed: racy reads of the server's statistics, taken after the
  // completions that ordered them.
  uint64_t opened() const { return view->stats().mappings_opened.load(std::memory_order_relaxed); }
  uint64_t closed() const { return view->stats().mappings_closed.load(std::memory_order_relaxed); }

  ServerConfig config;
  std::unique_ptr<shm::Segment> view;
};

// Lines of /proc/self/maps naming a buffer object of this server's workers.
int buffer_mappings(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  const std::string prefix = "/dev/shm/" + shm::segment_object_name(name) + ".p";
  int n = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.find(prefix) != std::string::npos) ++n;
  return n;
}

using test::connect;

}  // namespace

BOOST_AUTO_TEST_SUITE(handle_cache)

BOOST_AUTO_TEST_CASE(same_buffer_pushed_100_times_is_opened_once) {
  CacheServer s("cache100");
  auto w = connect(s.config.name);
  auto buf = w->register_buffer(16);
  BOOST_REQUIRE(buf.ok());
  std::fill_n(static_cast<float*>(buf->data), 4, -1.0f);
  for (int n = 0; n < 100; ++n) BOOST_REQUIRE(w->push(kAllTensors, buf->id, 0, 16, Dtype::kF32, 0).ok());
  BOOST_TEST(s.opened() == 1u);
  BOOST_TEST(s.closed() == 0u);
  BOOST_TEST(buffer_mappings(s.config.name) == 2);  // the worker's and the server's
  BOOST_REQUIRE(w->unregister_buffer(buf->id).ok());
  BOOST_TEST(s.closed() == 1u);
  // The worker's mapping lives as long as a Buffer's `mapping` does.
  BOOST_TEST(buffer_mappings(s.config.name) == 1);
  buf->mapping.reset();
  BOOST_TEST(buffer_mappings(s.config.name) == 0);
}

BOOST_AUTO_TEST_CASE(register_push_unregister_1000_times_leaves_no_mapping) {
  CacheServer s("cache1000");
  auto w = connect(s.config.name);
  const int before = buffer_mappings(s.config.name);
  for (int n = 0; n < 1000; ++n) {
    auto buf = w->register_buffer(16);
    BOOST_REQUIRE_MESSAGE(buf.ok(), buf.status().to_string());
    std::fill_n(static_cast<float*>(buf->data), 4, 1.0f);
    BOOST_REQUIRE(w->push(kAllTensors, buf->id, 0, 16, Dtype::kF32, 0).ok());
    BOOST_REQUIRE(w->unregister_buffer(buf->id).ok());
  }
  BOOST_TEST(s.opened() == 1000u);
  BOOST_TEST(s.closed() == s.opened());
  BOOST_TEST(buffer_mappings(s.config.name) == before);
  BOOST_TEST(before == 0);
}

BOOST_AUTO_TEST_CASE(recreated_object_of_the_same_name_gets_a_fresh_mapping) {
  CacheServer s("recycle");
  test::RawClient raw(s.config.name);
  const std::string object = shm::buffer_object_name(s.config.name, ::getpid(), 901);
  // `version`: the server's version before this round's push (the test
  // thread must not read Server::version() while the server runs).
  const auto round = [&](float g, uint64_t version) {
    // A new object under the old name, holding gradient g.
    auto obj = shm::ShmObject::create(object, 16, 0600);
    BOOST_REQUIRE_MESSAGE(obj.ok(), obj.status().to_string());
    std::fill_n(static_cast<float*>((*obj)->data()), 4, g);
    shm::BufferDesc& d = raw.segment().buffer(raw.id(), 0);
    std::memset(&d, 0, sizeof d);
    d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
    d.length = 16;
    std::memcpy(d.handle, object.c_str(), object.size() + 1);
    BOOST_REQUIRE_EQUAL(raw.call(raw.request(shm::Opcode::kRegisterBuffer)).code, 0u);
    shm::Request push = raw.request(shm::Opcode::kPush);
    push.tensor_id = shm::kAllTensors;
    push.byte_length = 16;
    push.dtype = 1;
    push.worker_version = version;
    BOOST_REQUIRE_EQUAL(raw.call(push).code, 0u);
    BOOST_REQUIRE_EQUAL(raw.call(raw.request(shm::Opcode::kUnregisterBuffer)).code, 0u);
    shm::ShmObject::remove(object);
  };
  round(1.0f, 0);  // w = -1
  round(2.0f, 1);  // w = -3 only if the second object was read, not the first's pages
  const auto stats_view = [&] { return s.opened() == 2u && s.closed() == 2u; };
  BOOST_TEST(stats_view());
  s.stop();
  const std::vector<float> weights = s.server->weights().value();
  for (float x : weights) BOOST_TEST(x == -3.0f);
  BOOST_TEST(buffer_mappings(s.config.name) == 0);
  raw.release_entry();
}

BOOST_AUTO_TEST_SUITE_END()
