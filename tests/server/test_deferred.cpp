// Deferred completions (backend.hpp, "Completion") without a GPU: the server
// runs in-process on a GatedBackend, the host backend whose fences stay
// open until the test releases them, as a device's work would. Checks that
// a push completes only after its fence, that other workers are served
// meanwhile, that one worker's completions keep request order, and that
// a buffer's mapping is closed only after the work using it is done.
#define BOOST_TEST_MODULE test_deferred
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <boost/test/unit_test.hpp>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <thread>

#include "backend.hpp"
#include "held_completions.hpp"
#include "raw_client.hpp"
#include "shmps/server/server.hpp"
#include "shmps/shm/segment.hpp"
#include "shmps/worker.hpp"
#include "test_support.hpp"
#include "worker_support.hpp"

using namespace shmps;
using namespace shmps::server;

namespace {

// What the test controls and observes; shared with the backend (which the
// server owns).
struct Gate {
  std::atomic<uint64_t> released{0};    // fences <= this are done
  std::atomic<uint64_t> issued{0};      // the last fence handed out
  std::atomic<int> live_peers{0};       // PeerBuffers not yet destroyed
  std::atomic<bool> lost{false};        // the "device" failed: a sticky error
  std::atomic<bool> reads_fail{false};  // a read of the weights fails, the device lives on (not sticky)
  // Run by each PeerBuffer's destructor (on the server's thread) when set;
  // set before the first registration.
  std::function<void()> on_peer_closed;
  void release_all() { released.store(UINT64_MAX, std::memory_order_release); }
};

class GatedPeer final : public PeerBuffer {
 public:
  GatedPeer(std::unique_ptr<PeerBuffer> inner, Gate* gate) : inner_(std::move(inner)), gate_(gate) {
    ++gate_->live_peers;
  }
  ~GatedPeer() override {
    if (gate_->on_peer_closed) gate_->on_peer_closed();
    --gate_->live_peers;
  }
  uint64_t length() const noexcept override { return inner_->length(); }
  const shm::ShmObject* host_object() const noexcept override { return inner_->host_object(); }
  PeerBuffer& inner() const { return *inner_; }

 private:
  std::unique_ptr<PeerBuffer> inner_;
  Gate* gate_;
};

const PeerBuffer& in(const PeerBuffer& p) { return static_cast<const GatedPeer&>(p).inner(); }
PeerBuffer& in(PeerBuffer& p) { return static_cast<GatedPeer&>(p).inner(); }

class GatedBackend final : public Backend {
 public:
  explicit GatedBackend(Gate* gate) : host_(make_host_backend()), gate_(gate) {}
  shm::Backend kind() const noexcept override { return shm::Backend::kHost; }
  bool asynchronous() const noexcept override { return true; }
  Fence fence() override {
    if (!dirty_) return gate_->issued.load() > gate_->released.load() ? gate_->issued.load() : 0;
    dirty_ = false;
    return ++gate_->issued;
  }
  Result<bool> fence_done(Fence f) override {
    if (gate_->lost.load()) return Status{ErrorCode::kCuda, "cudaErrorIllegalAddress (test)"};
    return f <= gate_->released.load(std::memory_order_acquire);
  }
  Status healthy() override {
    return gate_->lost.load() ? Status{ErrorCode::kCuda, "cudaErrorIllegalAddress (test): the context is lost"}
                              : Status::Ok();
  }
  Status synchronize() override { return healthy(); }
  Status allocate(const std::vector<TensorExtent>& t, size_t s, uint64_t total) override {
    return host_->allocate(t, s, total);
  }
  Status write_weights(uint64_t first, std::span<const float> values) override {
    return host_->write_weights(first, values);
  }
  Result<std::unique_ptr<PeerBuffer>> open_peer(const shm::BufferDesc& d, const PeerObjectRule& rule) override {
    auto p = host_->open_peer(d, rule);
    if (!p.ok()) return p.status();
    return std::unique_ptr<PeerBuffer>(new GatedPeer(std::move(p).value(), gate_));
  }
  Status peer_intact(const PeerBuffer& p) override { return host_->peer_intact(in(p)); }
  Result<bool> all_finite(const PeerBuffer& g, uint64_t off, uint64_t n, kernels::GradDtype d) override {
    return host_->all_finite(in(g), off, n, d);
  }
  Status apply(const kernels::OptimizerConfig& c, uint32_t t, uint64_t step, const PeerBuffer& g, uint64_t off,
               kernels::GradDtype d) override {
    dirty_ = true;
    return host_->apply(c, t, step, in(g), off, d);
  }
  Status copy_out(uint64_t e, uint64_t n, PeerBuffer& dst, uint64_t off) override {
    dirty_ = true;
    return host_->copy_out(e, n, in(dst), off);
  }
  Status copy_in(uint64_t e, uint64_t n, const PeerBuffer& src, uint64_t off) override {
    dirty_ = true;
    return host_->copy_in(e, n, in(src), off);
  }
  Result<std::vector<float>> read_weights() override {
    if (gate_->reads_fail.load()) return Status{ErrorCode::kCuda, "cudaErrorLaunchFailure (test): the read failed"};
    return host_->read_weights();
  }
  Status snapshot_weights(std::span<float> dst) override { return host_->snapshot_weights(dst); }
  Status add_to_weights(std::span<const float> delta) override { return host_->add_to_weights(delta); }
  Result<std::vector<float>> read_state() override { return host_->read_state(); }
  Status load(std::span<const float> w, std::span<const float> s) override { return host_->load(w, s); }

 private:
  std::unique_ptr<Backend> host_;
  Gate* gate_;
  bool dirty_ = false;
};

// An in-process server on the gated backend, run() on a thread.
struct GatedServer {
  // `checkpoint_dir`: checkpoints after every update into it, the newest kept.
  explicit GatedServer(const std::string& tag, const std::string& checkpoint_dir = "") {
    config.name = test::unique_name(tag);
    config.tensors = {{"w", {4}}};
    config.optimizer.lr = 1.0f;
    config.max_staleness = 1u << 20;
    config.backend = BackendKind::kHost;
    if (!checkpoint_dir.empty()) {
      config.checkpoint_dir = checkpoint_dir;
      config.checkpoint_every = 1;
      config.checkpoint_keep = 1;
    }
    auto s = Server::create(config, std::make_unique<GatedBackend>(&gate));
    BOOST_REQUIRE_MESSAGE(s.ok(), s.status().to_string());
    server = std::move(s).value();
    thread = std::thread([this] {
      const Status st = server->run();
      run_code = static_cast<uint32_t>(st.code());
      run_message = st.message();
      run_done = true;
    });
  }
  ~GatedServer() {
    gate.release_all();
    server->request_stop();
    thread.join();
  }
  Gate gate;
  ServerConfig config;
  std::unique_ptr<Server> server;
  std::thread thread;
  std::atomic<uint32_t> run_code{UINT32_MAX};
  std::string run_message;  // read after run_done
  std::atomic<bool> run_done{false};
};

// A 16-byte buffer object of this process, each float `fill`, described
// as buffer 0 of `raw`'s entry (registered by the test's own request);
// removed at scope exit.
struct RawBuffer {
  RawBuffer(test::RawClient& raw, const std::string& server, uint32_t tag, float fill)
      : object(shm::buffer_object_name(server, ::getpid(), tag)) {
    auto made = shm::ShmObject::create(object, 16, 0600);
    BOOST_REQUIRE(made.ok());
    mapping = std::move(made).value();
    std::fill_n(static_cast<float*>(mapping->data()), 4, fill);
    shm::BufferDesc& d = raw.segment().buffer(raw.id(), 0);
    std::memset(&d, 0, sizeof d);
    d.kind = static_cast<uint32_t>(shm::BufferKind::kHostShm);
    d.length = 16;
    std::memcpy(d.handle, object.c_str(), object.size() + 1);
  }
  ~RawBuffer() { shm::ShmObject::remove(object); }
  std::string object;
  std::unique_ptr<shm::ShmObject> mapping;
};

using test::connect;

}  // namespace

BOOST_AUTO_TEST_SUITE(deferred)

BOOST_AUTO_TEST_CASE(push_completes_after_its_fence_while_other_workers_are_served) {
  GatedServer s("defer");
  auto a = connect(s.config.name);
  auto b = connect(s.config.name);
  auto grad = a->register_buffer(16);
  BOOST_REQUIRE(grad.ok());
  std::fill_n(static_cast<float*>(grad->data), 4, -1.0f);
  auto ticket = a->push_async(kAllTensors, grad->id, 0, 16, Dtype::kF32, 0);
  BOOST_REQUIRE(ticket.ok());
  BOOST_REQUIRE(test::eventually([&] { return s.gate.issued.load() >= 1; }));
  // The fence is open: B is served, A's push waits.
  for (int i = 0; i < 20; ++i) BOOST_TEST(b->ping().ok());
  auto stats = b->stats();
  BOOST_REQUIRE(stats.ok());
  BOOST_TEST(stats->gradients_applied == 1u);  // enqueued (applied) but not completed
  std::atomic<bool> done{false};
  Result<uint64_t> version = Status{};
  std::thread waiter([&] {
    version = a->wait(*ticket);
    done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  BOOST_TEST(!done.load());
  s.gate.release_all();
  waiter.join();
  BOOST_REQUIRE_MESSAGE(version.ok(), version.status().to_string());
  BOOST_TEST(*version == 1u);
}

BOOST_AUTO_TEST_CASE(completions_of_one_worker_keep_request_order) {
  GatedServer s("order");
  test::RawClient raw(s.config.name);
  RawBuffer buffer(raw, s.config.name, 902, 1.0f);
  uint64_t id = 1;
  auto send = [&](shm::Request r) {
    r.request_id = id++;
    BOOST_REQUIRE(raw.send(r));
  };
  send(raw.request(shm::Opcode::kRegisterBuffer));
  BOOST_TEST(raw.receive().code == 0u);
  shm::Request push = raw.request(shm::Opcode::kPush);
  push.tensor_id = shm::kAllTensors;
  push.byte_length = 16;
  push.dtype = 1;
  send(push);                                           // 2: deferred
  send(raw.request(shm::Opcode::kPing));                // 3: synchronous, must wait behind 2
  send(raw.request(shm::Opcode::kUnregisterBuffer));    // 4: the mapping must outlive push 2's work
  shm::Request pull = raw.request(shm::Opcode::kPull);  // 5: buffer gone: rejected, still in order
  pull.tensor_id = shm::kAllTensors;
  pull.byte_length = 16;
  send(pull);
  const auto& stats = raw.segment().stats();
  // All four handled (relaxed reads of the server's counters: polled).
  BOOST_REQUIRE(test::eventually([&] { return stats.requests.load(std::memory_order_relaxed) >= 5; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  shm::Completion c{};
  BOOST_TEST(raw.segment().completions(raw.id()).tail.load() == 1u);  // only the register's answer
  BOOST_TEST(s.gate.live_peers.load() == 1);                          // unregistered, but push 2 still holds it
  BOOST_TEST(stats.mappings_closed.load(std::memory_order_relaxed) == 0u);
  s.gate.release_all();
  for (uint64_t want = 2; want <= 5; ++want) {
    c = raw.receive();
    BOOST_TEST(c.request_id == want);
  }
  BOOST_TEST(s.gate.live_peers.load() == 0);
  BOOST_TEST(stats.mappings_closed.load(std::memory_order_relaxed) == 1u);
  raw.release_entry();
}

// A detach's answer comes after the server closed the worker's buffers:
// the worker takes the answer, or its entry reading kDetached, as leave to
// destroy its events and free its memory, which CUDA IPC allows only once
// the importer has closed them. The host backend runs the same order.
BOOST_AUTO_TEST_CASE(a_detach_closes_the_buffers_before_the_entry_says_detached_or_the_answer_is_posted) {
  GatedServer s("detach");
  test::RawClient raw(s.config.name);
  RawBuffer buffer(raw, s.config.name, 904, 1.0f);
  std::atomic<uint64_t> owner_at_close{0};
  std::atomic<uint64_t> answers_at_close{UINT64_MAX};
  s.gate.on_peer_closed = [&] {
    owner_at_close = raw.segment().worker(raw.id()).owner.load();
    answers_at_close = raw.segment().completions(raw.id()).tail.load();
  };
  struct Unhook {  // before raw goes, even when a call throws
    Gate& gate;
    ~Unhook() { gate.on_peer_closed = nullptr; }
  } unhook{s.gate};
  BOOST_TEST(raw.call(raw.request(shm::Opcode::kRegisterBuffer)).code == 0u);
  BOOST_TEST(raw.call(raw.request(shm::Opcode::kDetach)).code == 0u);
  BOOST_TEST(s.gate.live_peers.load() == 0);
  BOOST_TEST(shm::owner_state(owner_at_close.load()) == static_cast<uint32_t>(shm::WorkerState::kAttached));
  BOOST_TEST(answers_at_close.load() == 1u);  // the register's answer only
  BOOST_TEST(shm::owner_state(raw.segment().worker(raw.id()).owner.load()) ==
             static_cast<uint32_t>(shm::WorkerState::kDetached));
  raw.release_entry();
}

BOOST_AUTO_TEST_CASE(a_dead_workers_mapping_is_closed_after_its_work) {
  GatedServer s("death");
  test::RawClient raw(s.config.name);
  RawBuffer buffer(raw, s.config.name, 903, 0.0f);
  shm::Request reg = raw.request(shm::Opcode::kRegisterBuffer);
  reg.request_id = 1;
  BOOST_REQUIRE(raw.send(reg));
  BOOST_TEST(raw.receive().code == 0u);
  shm::Request push = raw.request(shm::Opcode::kPush);
  push.request_id = 2;
  push.tensor_id = shm::kAllTensors;
  push.byte_length = 16;
  push.dtype = 1;
  BOOST_REQUIRE(raw.send(push));
  BOOST_REQUIRE(test::eventually([&] { return s.gate.issued.load() >= 1; }));
  // The session ends (the entry is freed without a detach, as by a worker
  // that died): the mapping stays until the push's work is done.
  raw.release_entry();
  auto other = connect(s.config.name);  // the server keeps serving
  BOOST_TEST(other->ping().ok());
  BOOST_TEST(s.gate.live_peers.load() == 1);
  s.gate.release_all();
  BOOST_TEST(test::eventually([&] { return s.gate.live_peers.load() == 0; }));
  BOOST_TEST(other->ping().ok());
}

BOOST_AUTO_TEST_CASE(a_lost_device_fails_the_push_and_stops_the_server_with_the_error) {
  GatedServer s("lost");
  auto a = connect(s.config.name);
  auto grad = a->register_buffer(16);
  BOOST_REQUIRE(grad.ok());
  std::fill_n(static_cast<float*>(grad->data), 4, 1.0f);
  auto ticket = a->push_async(kAllTensors, grad->id, 0, 16, Dtype::kF32, 0);
  BOOST_REQUIRE(ticket.ok());
  BOOST_REQUIRE(test::eventually([&] { return s.gate.issued.load() >= 1; }));
  s.gate.lost = true;  // its fence will never be done: the context is gone
  auto version = a->wait(*ticket);
  BOOST_REQUIRE(!version.ok());
  BOOST_TEST(version.status().code() == ErrorCode::kCuda, version.status().to_string());
  // run() ends by itself with the error (shmps-server exits non-zero).
  BOOST_REQUIRE(test::eventually([&] { return s.run_done.load(); }));
  BOOST_TEST(s.run_code.load() == static_cast<uint32_t>(ErrorCode::kCuda));
  BOOST_TEST(s.run_message.find("half-written") != std::string::npos, s.run_message);
  BOOST_TEST(!a->ping().ok());  // nothing more is served
}

// A read of the device that fails (a copy's error, with the context alive)
// writes no checkpoint: one of values that were never read would pass
// every check of the restore, and pruning would then delete the last good
// one. The failure is counted and logged, the server serves on, and the
// next try after the pause writes the version it missed.
BOOST_AUTO_TEST_CASE(a_failed_read_of_the_device_writes_no_checkpoint_and_prunes_none) {
  namespace fs = std::filesystem;
  test::TempDir dir("ckread");
  const fs::path first = dir.path / "ckpt-00000000000000000001.shmps";
  const fs::path second = dir.path / "ckpt-00000000000000000002.shmps";
  std::optional<GatedServer> s(std::in_place, "ckread", dir.path.string());
  s->gate.release_all();
  auto a = connect(s->config.name);
  auto grad = a->register_buffer(16);
  BOOST_REQUIRE(grad.ok());
  std::fill_n(static_cast<float*>(grad->data), 4, 1.0f);
  BOOST_REQUIRE(a->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, 0).ok());
  BOOST_REQUIRE(test::eventually([&] { return fs::exists(first); }));
  s->gate.reads_fail = true;
  BOOST_REQUIRE(a->push(kAllTensors, grad->id, 0, 16, Dtype::kF32, 1).ok());
  auto segment = shm::Segment::open(s->config.name, /*read_only=*/true);
  BOOST_REQUIRE_MESSAGE(segment.ok(), segment.status().to_string());
  const auto& failures = (*segment)->stats().checkpoint_failures;
  BOOST_REQUIRE(test::eventually([&] { return failures.load() >= 1; }));
  BOOST_TEST(a->ping().ok());
  BOOST_TEST(!fs::exists(second));
  BOOST_TEST(fs::exists(first));  // not pruned
  s->gate.reads_fail = false;
  BOOST_REQUIRE(test::eventually([&] { return fs::exists(second); }, std::chrono::seconds(10)));
  BOOST_TEST(test::eventually([&] { return !fs::exists(first); }));  // pruned once version 2 is on disk
  ServerConfig again = s->config;
  again.name = test::unique_name("ckread_again");
  segment = Status{};
  a.reset();
  s.reset();
  // What was written is what the weights were: -1 - 1 after two pushes of 1.
  auto restored = Server::create(again);
  BOOST_REQUIRE_MESSAGE(restored.ok(), restored.status().to_string());
  BOOST_TEST((*restored)->version() == 2u);
  BOOST_TEST((*restored)->weights().value() == std::vector<float>(4, -2.0f), boost::test_tools::per_element());
}

// A client that leaves its answers unread while its pushes wait for
// device work: the server takes a request only with room in the
// completion queue for its answer and for every answer held, so each held
// answer can be posted once its work is done. Taking more (up to a lane of
// held pushes behind a full queue) would leave answers it cannot post, and
// the loop would poll their fences without sleeping until the client read.
BOOST_AUTO_TEST_CASE(a_client_owing_reads_is_given_no_more_work_than_its_queue_can_answer) {
  GatedServer s("owing");
  test::RawClient raw(s.config.name);
  const uint32_t capacity = raw.segment().layout().lane_capacity;
  RawBuffer buffer(raw, s.config.name, 905, -1.0f);
  uint64_t id = 1;
  auto send = [&](shm::Request r) {
    r.request_id = id++;
    BOOST_REQUIRE(raw.send(r));
  };
  send(raw.request(shm::Opcode::kRegisterBuffer));
  BOOST_REQUIRE(raw.receive().code == 0u);
  const auto& stats = raw.segment().stats();
  for (uint32_t k = 0; k + 1 < capacity; ++k) send(raw.request(shm::Opcode::kPing));  // answered, left unread
  BOOST_REQUIRE(test::eventually([&] { return stats.requests.load(std::memory_order_relaxed) >= capacity; }));
  for (uint32_t k = 0; k < capacity; ++k) {  // a lane of pushes, each held behind an open fence once taken
    shm::Request push = raw.request(shm::Opcode::kPush);
    push.tensor_id = shm::kAllTensors;
    push.byte_length = 16;
    push.dtype = 1;
    push.worker_version = k;
    send(push);
  }
  // One slot is free: one push is taken, the rest wait in the lane.
  BOOST_REQUIRE(test::eventually([&] { return s.gate.issued.load() >= 1; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // three heartbeats' retries
  BOOST_TEST(stats.requests.load(std::memory_order_relaxed) == capacity + 1u);
  BOOST_TEST(s.gate.issued.load() == 1u);
  s.gate.release_all();
  // Its answer fills the queue; nothing is held, and the server sleeps.
  BOOST_REQUIRE(test::eventually([&] { return raw.segment().completions(raw.id()).tail.load() == capacity + 1u; }));
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  ::getrusage(RUSAGE_SELF, &after);
  const auto micros = [](const rusage& r) {
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1'000'000L + r.ru_utime.tv_usec + r.ru_stime.tv_usec;
  };
  BOOST_TEST(micros(after) - micros(before) < 250'000L,
             "this process used " << micros(after) - micros(before) << " us of CPU in a second");
  // Once read, the rest is taken and answered in order, every push applied.
  for (uint32_t k = 0; k + 1 < capacity; ++k) BOOST_TEST(raw.receive().code == 0u);
  for (uint32_t k = 0; k < capacity; ++k) {
    const shm::Completion c = raw.receive();
    BOOST_TEST(c.request_id == uint64_t{capacity} + 1 + k);
    BOOST_TEST(c.code == 0u);
    BOOST_TEST(c.version == k + 1u);
  }
  raw.release_entry();
}

// A stuck stream (a dead worker's event never recorded, say) is given up
// on after HeldCompletions::kStallNs whether its request's session holds
// the completion or has ended: orphaned work is not polled for ever either.
BOOST_AUTO_TEST_CASE(work_stalled_past_the_limit_is_an_error_held_or_orphaned) {
  Gate gate;
  GatedBackend backend(&gate);
  HeldCompletions held(2);
  held.hold(0, shm::Completion{}, 1, nullptr, 0);
  held.hold(1, shm::Completion{}, 1, nullptr, 0);
  held.orphan(1);  // worker 1's session ended with its work running
  const uint64_t limit = HeldCompletions::kStallNs;
  BOOST_TEST(held.release_finished(backend, limit).ok());  // running, within the limit: kept
  BOOST_TEST(!held.pop_ready(0, backend, limit).value().has_value());
  BOOST_TEST(!held.idle());
  const Status orphaned = held.release_finished(backend, limit + 1);
  BOOST_TEST(orphaned.code() == ErrorCode::kCuda);
  BOOST_TEST(orphaned.message().find("has not finished in 60 s") != std::string::npos, orphaned.message());
  BOOST_TEST(held.pop_ready(0, backend, limit + 1).status().code() == ErrorCode::kCuda);
  gate.release_all();
  BOOST_TEST(held.release_finished(backend, limit + 1).ok());
  BOOST_TEST(held.pop_ready(0, backend, limit + 1).value().has_value());
  BOOST_TEST(held.idle());
}

BOOST_AUTO_TEST_SUITE_END()
