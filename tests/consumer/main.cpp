// An out-of-tree worker built against the installed package
// (find_package(shmps)): with no server it gets kServerNotRunning naming the
// segment; against the server named in argv[1] (one tensor "w" of 4 fp32,
// SGD lr 1, zero initial weights) a pull, a push of g and a second pull give
// w = -g at version 1. Exit 0 when all of it holds; 1 with the reason.
#include <cstdio>
#include <cstring>
#include <string>

#include "shmps/worker.hpp"

namespace {
int fail(const std::string& why) {
  std::fprintf(stderr, "consumer: FAIL: %s\n", why.c_str());
  return 1;
}
}  // namespace

int main(int argc, char** argv) {
  shmps::WorkerOptions missing;
  missing.name = "consumer_no_such_server";
  auto none = shmps::Worker::connect(missing);
  if (none.ok() || none.status().code() != shmps::ErrorCode::kServerNotRunning ||
      none.status().message().find("consumer_no_such_server") == std::string::npos)
    return fail("connect to a missing server: " + none.status().to_string());
  std::printf("consumer: no server: %s\n", none.status().to_string().c_str());
  if (argc < 2) return 0;

  shmps::WorkerOptions options;
  options.name = argv[1];
  options.wait_for_server = std::chrono::seconds(10);
  auto worker = shmps::Worker::connect(options);
  if (!worker.ok()) return fail("connect: " + worker.status().to_string());
  shmps::Worker& w = **worker;
  if (w.total_elements() != 4)
    return fail("the server's model has " + std::to_string(w.total_elements()) + " elements, not 4");
  auto buffer = w.register_buffer(4 * sizeof(float));
  if (!buffer.ok()) return fail("register_buffer: " + buffer.status().to_string());
  auto version = w.pull(shmps::kAllTensors, buffer->id, 0);
  if (!version.ok() || *version != 0) return fail("first pull: " + version.status().to_string());
  const float g[4] = {1.0f, -2.0f, 0.5f, 4.0f};
  std::memcpy(buffer->data, g, sizeof g);
  auto pushed = w.push(shmps::kAllTensors, buffer->id, 0, sizeof g, shmps::Dtype::kF32, *version);
  if (!pushed.ok() || *pushed != 1) return fail("push: " + pushed.status().to_string());
  version = w.pull(shmps::kAllTensors, buffer->id, 0);
  if (!version.ok() || *version != 1) return fail("second pull: " + version.status().to_string());
  float weights[4];
  std::memcpy(weights, buffer->data, sizeof weights);
  for (int i = 0; i < 4; ++i)
    if (weights[i] != -g[i])
      return fail("weight " + std::to_string(i) + " is " + std::to_string(weights[i]) + ", not " +
                  std::to_string(-g[i]));
  std::printf("consumer: push and pull through '%s': w = -g at version 1\n", argv[1]);
  return 0;
}
