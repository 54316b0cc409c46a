// Turns shmps-server's command line and config file into a ServerConfig.
// Every option can be given on the command line (--key value) or in the
// file named by --config (key = value lines, '#' comments); the command
// line wins. Not thread-safe (Boost.Program_options state is local, but
// parse errors are reported through the return value only).
#pragma once

#include <string>

#include "shmps/server/config.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

struct ParsedOptions {
  ServerConfig config;
  bool help = false;         // --help was given: print help_text, exit 0
  std::string help_text;
};

// Errors: kInvalidArgument naming the option (and the config file) for an
// unknown key, a malformed value, a missing --name or --tensor, or invalid
// optimizer hyperparameters.
Result<ParsedOptions> parse_options(int argc, const char* const* argv);

// "fc1.weight:256x784[:f32]" -> TensorSpec. Errors: kInvalidArgument.
Result<shm::TensorSpec> parse_tensor(const std::string& text);

}  // namespace shmps::server
