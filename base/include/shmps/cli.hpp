// Checks shared by the command lines of shmps' programs (shmps-server,
// shmps-train, shmps-inspect, shmps-bench, shmps-compare), on top of
// Boost.Program_options. Header-only: include it only where
// Boost::program_options is linked. Pure functions; thread-safe.
#pragma once

#include <boost/program_options.hpp>
#include <cerrno>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <string>
#include <typeinfo>

namespace shmps::cli {

// What every program's --version prints: "<program> <version>" (help2man
// reads it for the man pages). SHMPS_VERSION comes from CMake
// (shmps_target_defaults).
inline std::string version_line(const std::string& program) { return program + " " + SHMPS_VERSION; }

// The command-line style of every program: program_options' default but
// for abbreviations (--max-stal for --max-staleness), which a config file
// refuses, and which an option added later would make ambiguous, breaking
// the scripts that used them.
inline constexpr int kStyle = boost::program_options::command_line_style::default_style &
                              ~boost::program_options::command_line_style::allow_guessing;

// True when `value`, given for option `d`, starts with '-' (after blanks)
// and `d` stores an unsigned integer. program_options reads such a value
// with lexical_cast, which wraps "-1" to the type's maximum: `--epochs -1`
// trained for ever, `max-staleness = -1` turned the staleness bound off.
inline bool negative_for_unsigned(const boost::program_options::option_description& d, const std::string& value) {
  const auto* typed = dynamic_cast<const boost::program_options::typed_value_base*>(d.semantic().get());
  if (typed == nullptr) return false;
  const std::type_info& t = typed->value_type();
  const bool is_unsigned = t == typeid(unsigned short) || t == typeid(unsigned) || t == typeid(unsigned long) ||
                           t == typeid(unsigned long long);
  const size_t first = value.find_first_not_of(" \t");
  return is_unsigned && first != std::string::npos && value[first] == '-';
}

// The largest value of the unsigned integer type option `d` stores
// (4294967295 for a 32-bit count), or 0 when it stores none.
inline unsigned long long unsigned_max(const boost::program_options::option_description& d) {
  const auto* typed = dynamic_cast<const boost::program_options::typed_value_base*>(d.semantic().get());
  if (typed == nullptr) return 0;
  const std::type_info& t = typed->value_type();
  return t == typeid(unsigned short)       ? USHRT_MAX
         : t == typeid(unsigned)           ? UINT_MAX
         : t == typeid(unsigned long)      ? ULONG_MAX
         : t == typeid(unsigned long long) ? ULLONG_MAX
                                           : 0;
}

// True when `value`, given for option `d`, is an integer (decimal digits
// after an optional '+') past unsigned_max(d) and `d` stores an unsigned
// integer. program_options refuses it without the reason ("the argument
// ('4294967296') for option '--ring-capacity' is invalid").
inline bool past_unsigned_max(const boost::program_options::option_description& d, const std::string& value) {
  const unsigned long long most = unsigned_max(d);
  const size_t first = value.starts_with('+') ? 1 : 0;
  if (most == 0 || value.size() == first || value.find_first_not_of("0123456789", first) != std::string::npos)
    return false;
  errno = 0;
  const unsigned long long v = std::strtoull(value.c_str() + first, nullptr, 10);
  return errno == ERANGE || v > most;
}

// True when option `d` stores a float (an fp32 hyperparameter).
inline bool stores_float(const boost::program_options::option_description& d) {
  const auto* typed = dynamic_cast<const boost::program_options::typed_value_base*>(d.semantic().get());
  return typed != nullptr && typed->value_type() == typeid(float);
}

// What a float option must be, for the messages of beyond_fp32().
inline constexpr const char* kFp32Range = "a finite fp32 number (at most 3.4028235e+38 in magnitude)";

// True when `value`, given for option `d`, reads as a finite number that
// fp32 cannot hold (1e39, -1e300) and `d` stores a float. program_options
// refuses it without the reason ("the argument ('1e39') for option '--lr'
// is invalid"). "inf" and "nan" are not: they read, and each option's own
// check refuses them.
inline bool beyond_fp32(const boost::program_options::option_description& d, const std::string& value) {
  if (!stores_float(d)) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(value.c_str(), &end);
  if (end == value.c_str() ||
      value.find_first_not_of(" \t", static_cast<size_t>(end - value.c_str())) != std::string::npos)
    return false;
  // ERANGE with an infinite result: a finite text past double's range too.
  // From FLT_MAX + half its ulp (0x1.ffffffp+127) on, fp32 rounds to
  // infinity; below, to FLT_MAX (3.4028235e+38 reads as a double just above
  // FLT_MAX, and is FLT_MAX in fp32).
  return (std::isfinite(v) || errno == ERANGE) && std::fabs(v) >= 0x1.ffffffp+127;
}

// Call before po::store(): throws boost::program_options::error
// "--<key> must be a non-negative integer, got '<value>'" for the first
// option of `parsed` that negative_for_unsigned() refuses, "--<key> must be
// a finite fp32 number (...), got '<value>'" for one that beyond_fp32()
// refuses, and "unexpected argument" for a word that no option takes.
inline void refuse_misread_values(const boost::program_options::parsed_options& parsed) {
  if (parsed.description == nullptr) return;
  for (const boost::program_options::option& opt : parsed.options) {
    // A word no positional option takes (a parser without positional()
    // leaves its key empty): store() would drop it silently, and
    // find_nothrow("") throws "ambiguous", listing every option.
    if (opt.string_key.empty())
      throw boost::program_options::error("unexpected argument '" + (opt.value.empty() ? "" : opt.value[0]) +
                                          "': every option is --name value (see --help)");
    const boost::program_options::option_description* d = parsed.description->find_nothrow(opt.string_key, false);
    if (d == nullptr) continue;
    for (const std::string& value : opt.value)
      if (negative_for_unsigned(*d, value))
        throw boost::program_options::error("--" + opt.string_key + " must be a non-negative integer, got '" + value +
                                            "'");
      else if (beyond_fp32(*d, value))
        throw boost::program_options::error("--" + opt.string_key + " must be " + kFp32Range + ", got '" + value + "'");
  }
}

// The command line against `desc`: parsed, refused when a negative value
// is given for an unsigned option or a float one gets a value past fp32
// (refuse_misread_values), stored and
// notified. Throws boost::program_options::error.
inline boost::program_options::variables_map parse(int argc, const char* const argv[],
                                                   const boost::program_options::options_description& desc) {
  namespace po = boost::program_options;
  const po::parsed_options parsed = po::command_line_parser(argc, argv).options(desc).style(kStyle).run();
  refuse_misread_values(parsed);
  po::variables_map vm;
  po::store(parsed, vm);
  po::notify(vm);
  return vm;
}

}  // namespace shmps::cli
