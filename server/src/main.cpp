// shmps-server: options -> ServerConfig -> run_server(). Nothing else here.
#include <cstdio>
#include <exception>

#include "shmps/server/options.hpp"
#include "shmps/server/server.hpp"

int main(int argc, char** argv) {
  try {
    auto parsed = shmps::server::parse_options(argc, argv);
    if (!parsed.ok()) {
      std::fprintf(stderr, "shmps-server: %s\n", parsed.status().message().c_str());
      return 2;
    }
    if (parsed->help) {
      std::fputs(parsed->help_text.c_str(), stdout);
      return 0;
    }
    const shmps::Status s = shmps::server::run_server(parsed->config);
    if (!s.ok()) {
      std::fprintf(stderr, "shmps-server: %s\n", s.to_string().c_str());
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shmps-server: fatal: %s\n", e.what());
    return 1;
  }
}
