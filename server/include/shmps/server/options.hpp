// Turns shmps-server's command line and config file into a ServerConfig,
// and a ServerConfig back into option text (for the start-up log, reloads
// and tests). Every option can be given on the command line (--key value)
// or in the file named by --config (key = value lines, '#' comments); the
// command line wins. All functions are reentrant (Boost.Program_options
// state is local; errors come back through the return value only).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shmps/server/config.hpp"
#include "shmps/status.hpp"

namespace shmps::server {

struct ParsedOptions {
  ServerConfig config;
  bool help = false;        // --help was given: print help_text, exit 0
  bool version = false;     // --version was given: print version_text(), exit 0
  bool check = false;       // --check-config: config is valid, and each entry a config file line; print it, exit 0
  uint32_t parent_pid = 0;  // --parent-pid: run_server()'s (0: none)
  // Keys the config file sets that the command line also gives (the
  // command line's value wins), each "config file F line N: key 'k' = v is
  // not used: ...": logged as warnings at start and at each reload.
  std::vector<std::string> shadowed;
  std::string help_text;
};

// Errors: kInvalidArgument naming the option for an unknown key, a
// malformed value, a missing --name or --tensor, or a value validate()
// refuses. An integer past its option's type is judged by the option's
// rule as the type's largest value, and the message quotes it as written
// ("--ring-capacity must be a power of two in 2..65536, got 4294967296");
// where the rule takes that, the type's range is the rule ("--max-staleness
// must be an integer in 0..18446744073709551615, got 99999999999999999999").
// When the offending value came from the config file the message
// names the file, the line and the key instead:
//   "config file /etc/shmps/job1.conf line 7: key 'lr': invalid value 'fast'"
//   "config file /etc/shmps/job1.conf line 3: unknown key 'learning-rate'"
// A key other than `tensor` given twice in the file is an error naming both
// lines; `[section]` lines are refused, and so are a value in quotes and a
// relative path (checkpoint-dir, init-file, fed-store's file:DIR), which
// the service would take from its working directory, not the file's. A
// relative path on the command line is made absolute against the working
// directory. A hyperparameter the chosen
// optimizer does not read, given on the command line or in the file, is
// refused naming each (momentum, dampening, nesterov are SGD's; beta1,
// beta2, eps, amsgrad Adam's and AdamW's):
//   "--optimizer adam does not use --momentum: an SGD option; remove it, or
//    choose --optimizer sgd" With --check-config the --init-file
// is read and checked as the start reads it (read_init_file(), config.hpp),
// and its error comes back unchanged (kIo or kInvalidArgument), as does the
// start's refusal of a checkpoint directory another live server holds (not
// the live server of the configuration's own name, which a restart stops
// first); and a value that no config file line holds as written
// (config_entries() must parse back) is refused, "--check-config cannot
// print --<key> '<value>' as a config file line: <why>".
Result<ParsedOptions> parse_options(int argc, const char* const* argv);

// "fc1.weight:256x784[:f32]" -> TensorSpec. Errors: kInvalidArgument.
Result<shm::TensorSpec> parse_tensor(const std::string& text);

// "error", "warn", "info", "debug"; parse_log_level returns false on other
// text.
const char* log_level_name(LogLevel level) noexcept;
bool parse_log_level(std::string_view text, LogLevel* out) noexcept;
// "reject", "wait", "scale" (shm::staleness_policy_name); false on other text.
bool parse_staleness_policy(std::string_view text, shm::StalenessPolicy* out) noexcept;

// Every option of `config` as (key, value) in --help order, spelt as a
// config file takes it: one `tensor` entry per tensor, `init-file`,
// `device` and `checkpoint-dir` only when set, and only the options the
// rest of it reads (config_reads()). Joined as "key = value" lines it
// parses back to the same config, but for a value that no line holds as
// written (a '#' after a blank, blanks at its ends, a line break, quotes),
// which parse_options() with --check-config refuses.
std::vector<std::pair<std::string, std::string>> config_entries(const ServerConfig& config);
// Whether `config` reads option `key`: false for one that only another
// setting makes read (--momentum under adam, --fed-store without gloo,
// --checkpoint-keep without --checkpoint-dir); true for every other key.
bool config_reads(const ServerConfig& config, std::string_view key);

// The weight decay of optimizer `kind` when --weight-decay is not given:
// 0.01 for AdamW (torch.optim.AdamW's), 0 for SGD and Adam.
float default_weight_decay(kernels::OptimizerKind kind) noexcept;

// The shmps release the server was built from, e.g. "0.1.0".
const char* version_text() noexcept;

}  // namespace shmps::server
