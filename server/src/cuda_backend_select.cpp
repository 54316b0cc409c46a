// Picks the backend Server::create() uses: --backend host | cuda | auto
// (cuda when a usable device is present, else host), or the factory a test
// installed. Consumer-thread / start-up only.
#include "backend.hpp"
#include "shmps/server/log.hpp"

namespace shmps::server {
namespace {
BackendFactory& test_factory() {
  static BackendFactory factory;
  return factory;
}
}  // namespace

void set_backend_factory_for_tests(BackendFactory factory) { test_factory() = std::move(factory); }

Result<std::unique_ptr<Backend>> select_backend(BackendKind kind, const std::string& device) {
  if (test_factory()) return test_factory()();
  switch (kind) {
    case BackendKind::kHost:
      return make_host_backend();
    case BackendKind::kCuda:
      return make_cuda_backend(device);
    case BackendKind::kAuto: {
      std::string why;
      if (!cuda_backend_available(&why)) {
        log::info("--backend auto: no CUDA device (" + why + "); using the host backend");
        return make_host_backend();
      }
      auto cuda = make_cuda_backend(device);
      if (cuda.ok()) return cuda;
      log::warn("--backend auto: a CUDA device is present but unusable (" + cuda.status().message() +
                "); using the host backend");
      return make_host_backend();
    }
  }
  return Status{ErrorCode::kInternal, "unknown backend kind"};
}

}  // namespace shmps::server
