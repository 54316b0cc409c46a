// The systems shmps-compare measures, behind one client interface: shmps
// (a shmps-server process, shmps::Worker), a Unix-domain stream socket, a
// Boost.Interprocess message_queue and ZeroMQ ipc:// REQ/REP. Every baseline
// server is a fork()ed process that applies kernels::apply_cpu SGD (lr 0.001)
// to a tensor as long as each gradient and replies with an 8-byte version.
// A Client is used by one process (the fork()ed worker that made it); make
// servers in the parent before any Client exists (fork and ZeroMQ contexts
// do not mix).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "shmps/kernels/optimizer.hpp"
#include "shmps/status.hpp"

namespace shmps::bench {

// The one update every system applies, and the in-process references
// too: SGD, lr kSgdLr, no momentum (the shmps servers get the same on
// their command line).
inline constexpr float kSgdLr = 0.001f;
kernels::OptimizerConfig sgd_config() noexcept;

enum class System { kShmps, kSocket, kMessageQueue, kZmq };
const char* system_name(System system) noexcept;
bool zmq_available() noexcept;  // built with libzmq

// One worker's connection: push() sends `bytes` of gradient (a multiple of
// 4, <= the max_bytes it was made with) and returns once the server applied
// it and replied.
class Client {
 public:
  virtual ~Client() = default;
  virtual Status push(uint64_t bytes) = 0;
};

// A running baseline server (not shmps: see ServerChild). The destructor
// kills it and removes its socket file / queues.
class BaselineServer {
 public:
  // max_bytes: the largest gradient it will receive.
  // Errors: kIo (fork, socket, queue creation).
  static Result<std::unique_ptr<BaselineServer>> start(System system, uint64_t max_bytes);
  ~BaselineServer();
  BaselineServer(const BaselineServer&) = delete;
  BaselineServer& operator=(const BaselineServer&) = delete;
  System system() const noexcept { return system_; }
  const std::string& address() const noexcept { return address_; }

 private:
  BaselineServer() = default;
  System system_ = System::kSocket;
  std::string address_;
  uint64_t max_bytes_ = 0;
  Child child_;
};

// Connects a client of `system` (address: the shmps segment name, or
// BaselineServer::address()) able to push up to max_bytes. A shmps push
// names a whole tensor: tensor i of the server is tensor_bytes[i] long, and
// a push of `bytes` goes to the tensor of that length (kInvalidArgument when
// none is). Baselines ignore tensor_bytes.
Result<std::unique_ptr<Client>> connect_client(System system, const std::string& address, uint64_t max_bytes,
                                               const std::vector<uint64_t>& tensor_bytes);

}  // namespace shmps::bench
