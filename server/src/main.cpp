// shmps-server: options -> ServerConfig -> run_server(). Nothing else here.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "shmps/server/log.hpp"
#include "shmps/server/options.hpp"
#include "shmps/server/server.hpp"

namespace {

// Descriptors 0-2 left closed by the launcher (`2>&-`) are opened on
// /dev/null: otherwise the next open() takes them, and a log line would
// be written into a worker's buffer object or a checkpoint file.
void fill_standard_descriptors() {
  for (int fd = 0; fd <= 2; ++fd)
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int null = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
      if (null >= 0 && null != fd) {
        ::dup2(null, fd);
        ::close(null);
      }
    }
}

}  // namespace

int main(int argc, char** argv) {
  // First: a SIGHUP (a reload sent as the service starts) must not end the
  // process while the options are parsed; it is remembered, and the reload
  // runs once the server serves.
  shmps::server::remember_early_reload_signal();
  fill_standard_descriptors();
  // A log written to a pipe whose reader is gone (`| tee` killed) fails
  // with EPIPE and is dropped (log.cpp), instead of ending the server
  // without its shutdown and final checkpoint.
  std::signal(SIGPIPE, SIG_IGN);
  try {
    auto parsed = shmps::server::parse_options(argc, argv);
    if (!parsed.ok()) {
      shmps::server::log::error(parsed.status().message());
      return 2;
    }
    if (parsed->help) {
      std::fputs(parsed->help_text.c_str(), stdout);
      return 0;
    }
    if (parsed->version) {
      std::printf("shmps-server %s\n", shmps::server::version_text());
      return 0;
    }
    // The file's lines that the command line overrides: warned of (on
    // stderr) by the check as by the start.
    for (const std::string& line : parsed->shadowed) shmps::server::log::warn(line);
    if (parsed->check) {
      for (const auto& [key, value] : shmps::server::config_entries(parsed->config))
        std::printf("%s = %s\n", key.c_str(), value.c_str());
      return 0;
    }
    // SIGHUP parses the same command line again (re-reading its --config).
    const std::vector<std::string> args(argv, argv + argc);
    const shmps::server::ServerExit end = shmps::server::run_server(parsed->config, args, parsed->parent_pid);
    if (!end.status.ok()) {
      shmps::server::log::error(end.status.to_string());
      // A configuration error exits as a bad option does (2: systemd does
      // not restart it); any other failure 1.
      return end.kind == shmps::server::FailureKind::kConfiguration ? 2 : 1;
    }
    return 0;
  } catch (const std::exception& e) {
    shmps::server::log::error(std::string("fatal: ") + e.what());
    return 1;
  }
}
