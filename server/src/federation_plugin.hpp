// The one entry point of a federation engine plugin (libshmps_fed_<kind>.so,
// loaded by make_federation_engine()): `shmps_fed_<kind>_make` creates the
// engine for `config` into *engine, or sets *status. Plugin and
// server are built together (same compiler, same shmps), so C++ types cross.
#pragma once

#include <memory>

#include "shmps/server/federation.hpp"
#include "shmps/status.hpp"

extern "C" {
using FederationEngineMaker = void(const shmps::server::FederationConfig& config,
                                   std::unique_ptr<shmps::server::FederationEngine>* engine, shmps::Status* status);
}
