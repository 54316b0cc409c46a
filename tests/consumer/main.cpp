// Links shmps::worker from an installed package and checks the error a
// user gets when no server runs. Exit 0 on the expected outcome.
#include <cstdio>

#include "shmps/worker.hpp"

int main() {
  shmps::WorkerOptions options;
  options.name = "consumer_no_such_server";
  auto worker = shmps::Worker::connect(options);
  if (worker.ok() || worker.status().code() != shmps::ErrorCode::kServerNotRunning) return 1;
  std::printf("consumer: %s\n", worker.status().to_string().c_str());
  return 0;
}
