// make_federation_engine(): the engine --federation names. An engine that
// needs a library of its own (MPI, Gloo) is a plugin, loaded here only when asked
// for, so that shmps-server starts on a host without that library. A
// plugin exports one C function, `shmps_fed_<kind>_make`, of type
// FederationEngineMaker (federation_plugin.hpp).
#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>

#include "federation_plugin.hpp"
#include "shmps/server/federation.hpp"

#ifndef SHMPS_PLUGIN_RELDIR
#define SHMPS_PLUGIN_RELDIR "../lib/shmps"
#endif

namespace shmps::server {

namespace {

// Where plugins live: $SHMPS_PLUGIN_DIR, else SHMPS_PLUGIN_RELDIR from
// the directory of the running executable.
std::string plugin_dir() {
  if (const char* env = std::getenv("SHMPS_PLUGIN_DIR"); env != nullptr && *env != '\0') return env;
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return SHMPS_PLUGIN_RELDIR;
  std::string dir(exe, static_cast<size_t>(n));
  dir.resize(dir.rfind('/') + 1);
  return dir + SHMPS_PLUGIN_RELDIR;
}

Result<std::unique_ptr<FederationEngine>> load_plugin(const FederationConfig& config, const char* kind,
                                                      const char* package) {
  const std::string path = plugin_dir() + "/libshmps_fed_" + kind + ".so";
  // RTLD_GLOBAL: an MPI library loads components of its own that resolve
  // its symbols globally (Open MPI's mca plugins). The handle is never
  // closed: the engine's code must outlive every engine.
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    return Status{ErrorCode::kIo, std::string("--federation ") + kind + ": cannot load " + path + " (" +
                                      (why != nullptr ? why : "unknown error") + "); install " + package +
                                      " and a shmps built with it, or set SHMPS_PLUGIN_DIR"};
  }
  const std::string symbol = std::string("shmps_fed_") + kind + "_make";
  auto* make = reinterpret_cast<FederationEngineMaker*>(::dlsym(handle, symbol.c_str()));
  if (make == nullptr)
    return Status{ErrorCode::kIo, path + " exports no " + symbol + ": not a shmps federation plugin"};
  std::unique_ptr<FederationEngine> engine;
  Status status;
  make(config, &engine, &status);
  if (!status.ok()) return status;
  return engine;
}

}  // namespace

Result<std::unique_ptr<FederationEngine>> make_federation_engine(const FederationConfig& config) {
  switch (config.kind) {
    case FederationKind::kNone:
      return Status{ErrorCode::kInvalidArgument, "--federation none has no engine"};
    case FederationKind::kMpi:
      return load_plugin(config, "mpi", "libopenmpi-dev (Debian)");
    case FederationKind::kGloo:
      return load_plugin(config, "gloo", "libgloo-dev (Debian)");
  }
  return Status{ErrorCode::kInvalidArgument, "unknown --federation kind"};
}

}  // namespace shmps::server
