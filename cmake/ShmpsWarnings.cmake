# shmps_target_defaults(target): warnings and sanitizer flags for our own
# targets only, and SHMPS_VERSION (the project's version, what every
# program's --version prints).
function(shmps_target_defaults target)
  target_compile_definitions(${target} PRIVATE SHMPS_VERSION="${PROJECT_VERSION}")
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wpedantic>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${SHMPS_WERROR}>>:-Werror>)
endfunction()

if(SHMPS_SANITIZER STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(SHMPS_SANITIZER STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT SHMPS_SANITIZER STREQUAL "")
  message(FATAL_ERROR "SHMPS_SANITIZER must be '', 'address' or 'thread'")
endif()
