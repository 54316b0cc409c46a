#include "compare_systems.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <boost/date_time/posix_time/posix_time_types.hpp>
#include <boost/interprocess/ipc/message_queue.hpp>
#include <cerrno>
#include <cstring>
#include <functional>
#include <vector>

#include "shmps/kernels/optimizer.hpp"
#include "shmps/worker.hpp"

#ifndef SHMPS_COMPARE_ZMQ
#define SHMPS_COMPARE_ZMQ 0
#endif
#if SHMPS_COMPARE_ZMQ
#include <zmq.h>
#endif

namespace shmps::bench {

namespace bip = boost::interprocess;

namespace {

constexpr float kGradValue = 1e-4f;  // finite and small: weights stay finite
constexpr size_t kMqChunk = 64 * 1024;
constexpr size_t kMqDepth = 16;

Status io_error(const std::string& what) { return {ErrorCode::kIo, what + ": " + std::strerror(errno)}; }

// A baseline server's set-up (its weights, and for the socket and the
// queue a receive buffer: 1-2x the largest gradient, written page by page)
// takes seconds of both CPUs at 256 MiB. It says through this pipe when it
// is done, and fork_server() waits for that, so that no set-up runs under
// another system's timed pushes (it would slow the row measured first).
void signal_ready(int ready_fd) {
  const char byte = 1;
  while (::write(ready_fd, &byte, 1) < 0 && errno == EINTR) {
  }
  ::close(ready_fd);
}

// The server side shared by the baselines: weights as long as the largest
// gradient; each gradient updates its first bytes/4 elements.
class Applier {
 public:
  explicit Applier(uint64_t max_bytes) : config_(sgd_config()), weights_(max_bytes / sizeof(float), 0.5f) {}
  uint64_t apply(const void* grad, uint64_t bytes) {
    kernels::TensorState tensor;
    tensor.weights = weights_.data();
    tensor.n = std::min<uint64_t>(bytes / sizeof(float), weights_.size());
    kernels::apply_cpu(config_, tensor, grad, kernels::GradDtype::kF32, ++step_);
    return step_;
  }

 private:
  kernels::OptimizerConfig config_;
  std::vector<float> weights_;
  uint64_t step_ = 0;
};

// ------------------------------------------------------------ Unix socket

// One thread, poll() over the listening socket and every connection (the
// analogue of shmps's single consumer). A request: 8-byte length, then the
// gradient; the reply: the 8-byte version.
int socket_server(const std::string& path, int listen_fd, uint64_t max_bytes, int ready_fd) {
  Applier applier(max_bytes);
  std::vector<char> grad(max_bytes);
  signal_ready(ready_fd);
  std::vector<pollfd> fds{{listen_fd, POLLIN, 0}};
  while (true) {
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return 1;
    }
    if (fds[0].revents & POLLIN) {
      const int c = ::accept(listen_fd, nullptr, nullptr);
      if (c >= 0) fds.push_back({c, POLLIN, 0});
    }
    for (size_t i = 1; i < fds.size();) {
      if (fds[i].revents == 0) {
        ++i;
        continue;
      }
      uint64_t bytes = 0;
      bool ok =
          read_full(fds[i].fd, &bytes, sizeof bytes) && bytes <= max_bytes && read_full(fds[i].fd, grad.data(), bytes);
      if (ok) {
        const uint64_t version = applier.apply(grad.data(), bytes);
        ok = write_full(fds[i].fd, &version, sizeof version);
      }
      if (!ok) {
        ::close(fds[i].fd);
        fds.erase(fds.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      fds[i].revents = 0;
      ++i;
    }
  }
  (void)path;
}

class SocketClient final : public Client {
 public:
  static Result<std::unique_ptr<Client>> connect(const std::string& path, uint64_t max_bytes) {
    std::unique_ptr<SocketClient> c(new SocketClient());
    c->grad_.assign(max_bytes / sizeof(float), kGradValue);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    const uint64_t deadline = now_ns() + 10'000'000'000ull;
    while (true) {
      c->fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (c->fd_ < 0) return io_error("socket");
      if (::connect(c->fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) break;
      ::close(c->fd_);
      c->fd_ = -1;
      if (now_ns() > deadline) return io_error("connect " + path);
      sleep_ns(1'000'000);
    }
    const timeval timeout{30, 0};  // a dead server fails the read instead of hanging it
    ::setsockopt(c->fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    return std::unique_ptr<Client>(std::move(c));
  }
  ~SocketClient() override {
    if (fd_ >= 0) ::close(fd_);
  }
  Status push(uint64_t bytes) override {
    uint64_t version = 0;
    // Header and gradient in one sendmsg would save a syscall for small
    // gradients; two writes is what most hand-written servers do.
    if (!write_full(fd_, &bytes, sizeof bytes) || !write_full(fd_, grad_.data(), bytes) ||
        !read_full(fd_, &version, sizeof version))
      return io_error("unix socket push");
    return Status::Ok();
  }

 private:
  SocketClient() = default;
  int fd_ = -1;
  std::vector<float> grad_;
};

// ------------------------------------------------------------ message_queue

std::string mq_request_name(const std::string& base) { return base + "_req"; }
std::string mq_reply_name(const std::string& base) { return base + "_rep"; }

// A request: one 8-byte message with the length, then ceil(bytes / 64 KiB)
// chunks, reassembled in order; the reply: the 8-byte version. One client.
int mq_server(const std::string& base, uint64_t max_bytes, int ready_fd) {
  try {
    bip::message_queue requests(bip::open_only, mq_request_name(base).c_str());
    bip::message_queue replies(bip::open_only, mq_reply_name(base).c_str());
    Applier applier(max_bytes);
    std::vector<char> grad(max_bytes + kMqChunk);
    signal_ready(ready_fd);
    while (true) {
      // receive() refuses a buffer shorter than the queue's message size.
      uint64_t bytes = 0;
      bip::message_queue::size_type got = 0;
      unsigned priority = 0;
      requests.receive(grad.data(), kMqChunk, got, priority);
      if (got != sizeof bytes) return 2;
      std::memcpy(&bytes, grad.data(), sizeof bytes);
      if (bytes > max_bytes) return 2;
      for (uint64_t off = 0; off < bytes; off += got) {
        requests.receive(grad.data() + off, kMqChunk, got, priority);
        if (got == 0) return 2;
      }
      const uint64_t version = applier.apply(grad.data(), bytes);
      replies.send(&version, sizeof version, 0);
    }
  } catch (const std::exception&) {
    return 1;
  }
}

class MqClient final : public Client {
 public:
  static Result<std::unique_ptr<Client>> connect(const std::string& base, uint64_t max_bytes) {
    try {
      std::unique_ptr<MqClient> c(new MqClient(base));
      c->grad_.assign(max_bytes / sizeof(float), kGradValue);
      return std::unique_ptr<Client>(std::move(c));
    } catch (const std::exception& e) {
      return Status{ErrorCode::kIo, std::string("message_queue open: ") + e.what()};
    }
  }
  Status push(uint64_t bytes) override {
    try {
      // Timed, the sends too: a dead server leaves the request queue full
      // (kMqDepth chunks), and a plain send() would block for ever. The
      // deadline is the whole push's: 30 s past its start.
      const auto deadline = boost::posix_time::microsec_clock::universal_time() + boost::posix_time::seconds(30);
      if (!requests_.timed_send(&bytes, sizeof bytes, 0, deadline))
        return {ErrorCode::kTimeout, "message_queue push: the server took no request within 30 s"};
      const char* p = reinterpret_cast<const char*>(grad_.data());
      for (uint64_t off = 0; off < bytes; off += kMqChunk)
        if (!requests_.timed_send(p + off, std::min<uint64_t>(kMqChunk, bytes - off), 0, deadline))
          return {ErrorCode::kTimeout, "message_queue push: the server took no chunk within 30 s of the push's start"};
      uint64_t version = 0;
      bip::message_queue::size_type got = 0;
      unsigned priority = 0;
      if (!replies_.timed_receive(&version, sizeof version, got, priority, deadline))
        return {ErrorCode::kTimeout, "message_queue push: no reply within 30 s of the push's start"};
      return Status::Ok();
    } catch (const std::exception& e) {
      return {ErrorCode::kIo, std::string("message_queue push: ") + e.what()};
    }
  }

 private:
  explicit MqClient(const std::string& base)
      : requests_(bip::open_only, mq_request_name(base).c_str()),
        replies_(bip::open_only, mq_reply_name(base).c_str()) {}
  bip::message_queue requests_;
  bip::message_queue replies_;
  std::vector<float> grad_;
};

// ------------------------------------------------------------ ZeroMQ

#if SHMPS_COMPARE_ZMQ
// REP socket: each request message is the gradient, applied from the
// received message in place; the reply is the 8-byte version.
int zmq_server(const std::string& endpoint, uint64_t max_bytes, int ready_fd) {
  void* ctx = zmq_ctx_new();
  void* rep = zmq_socket(ctx, ZMQ_REP);
  if (zmq_bind(rep, endpoint.c_str()) != 0) return 1;
  Applier applier(max_bytes);
  signal_ready(ready_fd);
  while (true) {
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    if (zmq_msg_recv(&msg, rep, 0) < 0) {
      zmq_msg_close(&msg);
      if (errno == EINTR) continue;
      return 1;
    }
    const uint64_t version = applier.apply(zmq_msg_data(&msg), std::min<uint64_t>(zmq_msg_size(&msg), max_bytes));
    zmq_msg_close(&msg);
    if (zmq_send(rep, &version, sizeof version, 0) < 0) return 1;
  }
}

class ZmqClient final : public Client {
 public:
  static Result<std::unique_ptr<Client>> connect(const std::string& endpoint, uint64_t max_bytes) {
    std::unique_ptr<ZmqClient> c(new ZmqClient());
    c->grad_.assign(max_bytes / sizeof(float), kGradValue);
    c->ctx_ = zmq_ctx_new();
    c->req_ = zmq_socket(c->ctx_, ZMQ_REQ);
    const int timeout_ms = 30000;
    zmq_setsockopt(c->req_, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    if (zmq_connect(c->req_, endpoint.c_str()) != 0)
      return Status{ErrorCode::kIo, std::string("zmq_connect: ") + zmq_strerror(zmq_errno())};
    return std::unique_ptr<Client>(std::move(c));
  }
  ~ZmqClient() override {
    if (req_ != nullptr) {
      const int linger = 0;
      zmq_setsockopt(req_, ZMQ_LINGER, &linger, sizeof linger);
      zmq_close(req_);
    }
    if (ctx_ != nullptr) zmq_ctx_term(ctx_);
  }
  Status push(uint64_t bytes) override {
    uint64_t version = 0;
    if (zmq_send(req_, grad_.data(), bytes, 0) < 0 || zmq_recv(req_, &version, sizeof version, 0) != sizeof version)
      return {ErrorCode::kIo, std::string("zmq push: ") + zmq_strerror(zmq_errno())};
    return Status::Ok();
  }

 private:
  ZmqClient() = default;
  void* ctx_ = nullptr;
  void* req_ = nullptr;
  std::vector<float> grad_;
};
#endif

// ------------------------------------------------------------ shmps

class ShmpsClient final : public Client {
 public:
  static Result<std::unique_ptr<Client>> connect(const std::string& name, uint64_t max_bytes,
                                                 const std::vector<uint64_t>& tensor_bytes) {
    std::unique_ptr<ShmpsClient> c(new ShmpsClient());
    WorkerOptions options;
    options.name = name;
    options.timeout = std::chrono::seconds(60);
    auto w = Worker::connect(options);
    if (!w.ok()) return w.status();
    c->worker_ = std::move(w).value();
    auto buf = c->worker_->register_buffer(max_bytes);
    if (!buf.ok()) return buf.status();
    c->buffer_ = *buf;
    std::fill_n(static_cast<float*>(c->buffer_.data), max_bytes / sizeof(float), kGradValue);
    // Gradients up to 4 KiB (the latency rows) come from a buffer of their
    // own, as a worker with small tensors would register. The start of a
    // big buffer can sit a power of two below the server's arrays, which
    // AMD's L1 way predictor punishes (server/src/host_backend.cpp).
    auto small = c->worker_->register_buffer(kSmallBytes);
    if (!small.ok()) return small.status();
    c->small_ = *small;
    std::fill_n(static_cast<float*>(c->small_.data), kSmallBytes / sizeof(float), kGradValue);
    c->tensor_bytes_ = tensor_bytes;
    // Pushes carry the version they were computed at: start from the
    // server's (earlier workers of the run moved it).
    auto stats = c->worker_->stats();
    if (!stats.ok()) return stats.status();
    c->version_ = stats->version;
    return std::unique_ptr<Client>(std::move(c));
  }
  Status push(uint64_t bytes) override {
    const auto it = std::find(tensor_bytes_.begin(), tensor_bytes_.end(), bytes);
    if (it == tensor_bytes_.end())
      return {ErrorCode::kInvalidArgument, "no tensor of " + std::to_string(bytes) + " bytes"};
    const auto tensor = static_cast<uint32_t>(it - tensor_bytes_.begin());
    const uint32_t buffer = bytes <= kSmallBytes ? small_.id : buffer_.id;
    auto v = worker_->push(tensor, buffer, 0, bytes, Dtype::kF32, version_);
    if (!v.ok()) return v.status();
    version_ = *v;
    return Status::Ok();
  }

 private:
  ShmpsClient() = default;
  static constexpr uint64_t kSmallBytes = 4096;
  std::unique_ptr<Worker> worker_;
  Buffer buffer_;
  Buffer small_;
  std::vector<uint64_t> tensor_bytes_;
  uint64_t version_ = 0;
};

}  // namespace

kernels::OptimizerConfig sgd_config() noexcept {
  kernels::OptimizerConfig config;
  config.lr = kSgdLr;
  return config;
}

const char* system_name(System system) noexcept {
  switch (system) {
    case System::kShmps:
      return "shmps";
    case System::kSocket:
      return "unix socket";
    case System::kMessageQueue:
      return "boost mq";
    case System::kZmq:
      return "zeromq ipc";
  }
  return "?";
}

bool zmq_available() noexcept { return SHMPS_COMPARE_ZMQ != 0; }

namespace {

// Forks a baseline server running fn(ready_fd) and returns once it has
// called signal_ready(ready_fd). Errors: kIo when it exits first (EOF on
// the pipe: its copy of the write end closed) or is not set up in 120 s;
// the returned Child's destructor then kills it.
Result<Child> fork_server(System system, const std::function<int(int)>& fn) {
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC) != 0) return io_error("pipe2");
  const int write_end = ready[1];
  Result<Child> child = fork_child([&fn, write_end] { return fn(write_end); });
  ::close(write_end);
  if (!child.ok()) {
    ::close(ready[0]);
    return child;
  }
  pollfd p{ready[0], POLLIN, 0};
  int polled = 0;
  while ((polled = ::poll(&p, 1, 120'000)) < 0 && errno == EINTR && stop_signal() == 0) {
  }
  const Status poll_failed = stop_signal() != 0 ? stopped_status() : polled < 0 ? io_error("poll") : Status::Ok();
  char byte = 0;
  const bool ready_now = polled == 1 && ::read(ready[0], &byte, 1) == 1;
  ::close(ready[0]);
  if (!poll_failed.ok()) return poll_failed;
  if (!ready_now)
    return Status{ErrorCode::kIo, std::string(system_name(system)) +
                                      " server: " + (polled == 0 ? "not set up within 120 s" : "exited during set-up")};
  return child;
}

}  // namespace

Result<std::unique_ptr<BaselineServer>> BaselineServer::start(System system, uint64_t max_bytes) {
  std::unique_ptr<BaselineServer> s(new BaselineServer());
  s->system_ = system;
  s->max_bytes_ = max_bytes;
  static int serial = 0;
  const std::string tag = "shmps_cmp_" + std::to_string(::getpid()) + "_" + std::to_string(serial++);
  Result<Child> child = Status{ErrorCode::kInvalidArgument, "no baseline server for shmps"};
  if (system == System::kSocket) {
    s->address_ = "/tmp/" + tag + ".sock";
    ::unlink(s->address_.c_str());
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return io_error("socket");
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", s->address_.c_str());
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 64) != 0) {
      ::close(fd);
      return io_error("bind/listen " + s->address_);
    }
    const std::string path = s->address_;
    child = fork_server(system,
                        [path, fd, max_bytes](int ready_fd) { return socket_server(path, fd, max_bytes, ready_fd); });
    ::close(fd);
  } else if (system == System::kMessageQueue) {
    s->address_ = tag;
    try {
      bip::message_queue::remove(mq_request_name(tag).c_str());
      bip::message_queue::remove(mq_reply_name(tag).c_str());
      bip::message_queue requests(bip::create_only, mq_request_name(tag).c_str(), kMqDepth, kMqChunk);
      bip::message_queue replies(bip::create_only, mq_reply_name(tag).c_str(), 4, sizeof(uint64_t));
    } catch (const std::exception& e) {
      return Status{ErrorCode::kIo, std::string("message_queue create: ") + e.what()};
    }
    child = fork_server(system, [tag, max_bytes](int ready_fd) { return mq_server(tag, max_bytes, ready_fd); });
  } else if (system == System::kZmq) {
#if SHMPS_COMPARE_ZMQ
    s->address_ = "ipc:///tmp/" + tag + ".zmq";
    const std::string endpoint = s->address_;
    child =
        fork_server(system, [endpoint, max_bytes](int ready_fd) { return zmq_server(endpoint, max_bytes, ready_fd); });
#else
    return Status{ErrorCode::kInvalidArgument, "built without libzmq"};
#endif
  }
  if (!child.ok()) return child.status();
  s->child_ = std::move(child).value();
  return s;
}

BaselineServer::~BaselineServer() {
  child_ = Child();  // SIGKILL and reap
  if (system_ == System::kSocket) ::unlink(address_.c_str());
  if (system_ == System::kZmq) ::unlink(address_.substr(std::strlen("ipc://")).c_str());
  if (system_ == System::kMessageQueue) {
    bip::message_queue::remove(mq_request_name(address_).c_str());
    bip::message_queue::remove(mq_reply_name(address_).c_str());
  }
}

Result<std::unique_ptr<Client>> connect_client(System system, const std::string& address, uint64_t max_bytes,
                                               const std::vector<uint64_t>& tensor_bytes) {
  switch (system) {
    case System::kShmps:
      return ShmpsClient::connect(address, max_bytes, tensor_bytes);
    case System::kSocket:
      return SocketClient::connect(address, max_bytes);
    case System::kMessageQueue:
      return MqClient::connect(address, max_bytes);
    case System::kZmq:
#if SHMPS_COMPARE_ZMQ
      return ZmqClient::connect(address, max_bytes);
#else
      break;
#endif
  }
  return Status{ErrorCode::kInvalidArgument, std::string(system_name(system)) + ": not built"};
}

}  // namespace shmps::bench
