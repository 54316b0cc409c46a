// Picks the backend Server::create() uses: --backend host | cuda | auto
// (cuda when a usable device is present, else host). Start-up only.
#include "backend.hpp"
#include "shmps/server/log.hpp"

namespace shmps::server {
Result<std::unique_ptr<Backend>> select_backend(BackendKind kind, const std::string& device) {
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
