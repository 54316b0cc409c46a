# SHMPS_FUZZ=ON (included by the top-level CMakeLists.txt before any target):
# libFuzzer needs clang, and every target of the build is compiled with
# coverage instrumentation for it and checked by ASan+UBSan; libstdc++'s
# vector annotations let ASan see reads past a vector's size, not only past
# its allocation.
if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "SHMPS_FUZZ=ON needs clang (libFuzzer), but the C++ compiler is "
                      "${CMAKE_CXX_COMPILER_ID}. Configure a separate build folder with "
                      "-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DSHMPS_FUZZ=ON.")
endif()
if(NOT SHMPS_SANITIZER STREQUAL "")
  message(FATAL_ERROR "SHMPS_FUZZ=ON brings its own sanitizers (ASan+UBSan); leave SHMPS_SANITIZER empty.")
endif()
add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer
                    -fno-sanitize-recover=undefined -D_GLIBCXX_SANITIZE_VECTOR=1)
add_link_options(-fsanitize=address,undefined)
