# xgrammar's C++ core (Apache-2.0), the grammar engine of structured outputs
# (src/engine/grammar.h): fetched by scripts/fetch-xgrammar (pinned version and
# SHA-256, cached) and compiled here with the build type's flags alone (included
# before duet's own: CMakeLists.txt). Its Python bindings are left out; so is its own CMake,
# which turns them on from its config.cmake whatever -D says and builds with LTO.
# DUET_XGRAMMAR_DIR names an unpacked source tree instead (offline builds).
set(DUET_XGRAMMAR_DIR "" CACHE PATH "xgrammar source tree (default: scripts/fetch-xgrammar)")
if(NOT DUET_XGRAMMAR_DIR)
  execute_process(COMMAND ${PROJECT_SOURCE_DIR}/scripts/fetch-xgrammar
    OUTPUT_VARIABLE _xgr_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _xgr_rc)
  if(NOT _xgr_rc EQUAL 0)
    message(FATAL_ERROR "scripts/fetch-xgrammar failed (${_xgr_rc}); set DUET_XGRAMMAR_DIR to an unpacked xgrammar sdist")
  endif()
  set(DUET_XGRAMMAR_DIR ${_xgr_dir} CACHE PATH "xgrammar source tree (default: scripts/fetch-xgrammar)" FORCE)
endif()
if(NOT EXISTS ${DUET_XGRAMMAR_DIR}/include/xgrammar/xgrammar.h)
  message(FATAL_ERROR "DUET_XGRAMMAR_DIR=${DUET_XGRAMMAR_DIR} holds no include/xgrammar/xgrammar.h")
endif()
file(GLOB_RECURSE DUET_XGRAMMAR_SOURCES CONFIGURE_DEPENDS ${DUET_XGRAMMAR_DIR}/cpp/*.cc)
list(FILTER DUET_XGRAMMAR_SOURCES EXCLUDE REGEX "/cpp/(tvm_ffi|nanobind)/")
add_library(duet_xgrammar STATIC ${DUET_XGRAMMAR_SOURCES})
# Its own code, not ours: its warnings are not duet's to fix (-w), and it is C++17.
set_target_properties(duet_xgrammar PROPERTIES CXX_STANDARD 17 POSITION_INDEPENDENT_CODE ON)
target_compile_options(duet_xgrammar PRIVATE -w)
# The sanitizer builds (Release too: Makefile SAN_CMAKE) leave it uninstrumented,
# with the release build's very command line, so ccache gives them its objects:
# instrumented, it was 427 of a clean ASan build's 1394 CPU seconds so far on the
# 2-core Zen 1 (2026-12-06), against CI's 90 minutes. What that gives up: a bad
# access inside xgrammar (a well-tested library; it compiles single-threaded here,
# GrammarSet: max_threads 1) is not reported. duet's side of every call (the masks
# it fills, the strings it is given) is instrumented, and grammar_test checks the
# masks it fills against every token of the vocabulary tried one by one.
target_include_directories(duet_xgrammar SYSTEM PUBLIC ${DUET_XGRAMMAR_DIR}/include
  ${DUET_XGRAMMAR_DIR}/3rdparty/dlpack/include)
target_include_directories(duet_xgrammar SYSTEM PRIVATE ${DUET_XGRAMMAR_DIR}/3rdparty/picojson)
# Its log goes to duet (src/engine/grammar.cpp defines the two functions): warnings,
# which say a constraint is dropped, become errors there instead of stderr lines.
target_compile_definitions(duet_xgrammar PUBLIC XGRAMMAR_ENABLE_CPPTRACE=0 XGRAMMAR_ENABLE_INTERNAL_CHECK=0
  XGRAMMAR_LOG_CUSTOMIZE=1)
target_link_libraries(duet_xgrammar PUBLIC Threads::Threads)
