// SHMPS_KERNEL_CLONES: the hot loops are compiled twice, for x86-64-v3
// (AVX2: 8 fp32 per instruction) and for the baseline (SSE2), and the loader
// picks one per machine (GCC function multiversioning, an ifunc). The math
// is the same separately rounded operations either way (-ffp-contract=off:
// no FMA), so both give the same bits (tests/kernels check the clone the
// machine they run on picks against scalar references). AVX2 pays at
// cache-resident sizes; from 1 MiB memory bandwidth bounds both
// (docs/benchmarks.md, "The kernels in one process"). GCC only: other
// compilers build the baseline loop. Not under ThreadSanitizer: the loader
// runs the clones' resolver (an ifunc) before the TSan runtime is up, and
// it crashes there.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define SHMPS_KERNEL_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SHMPS_KERNEL_CLONES
#endif
