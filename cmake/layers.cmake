# The layers of DESIGN.md as build targets, and a build that fails on an upward
# include.
#
#   base <- shm <- kv <- model <- cuda (with DUET_CUDA) <- engine <- roles <- bench <- cli
#   kernels/cpu sits below kv, kernels/cuda below cuda: they include nothing of duet.
#
# Each layer's targets see headers only through its view: a directory of the
# build tree holding symbolic links to the layer's own source folder and those of
# the layers below it (base -> src/base, shm -> shm, kernels/cpu -> kernels/cpu, ...),
# so `#include "roles/front.h"` from src/model finds nothing and fails to compile.
# A header's own includes are checked by a translation unit per header compiled in
# its layer's view (duet_header_checks: every header also compiles on its own).

set(DUET_VIEWS ${CMAKE_BINARY_DIR}/layer-views)

# duet_layer_view(NAME LINK=SOURCE_FOLDER...): the view directory of layer NAME.
function(duet_layer_view name)
  set(dir ${DUET_VIEWS}/${name})
  file(REMOVE_RECURSE ${dir})
  file(MAKE_DIRECTORY ${dir})
  foreach(entry ${ARGN})
    string(REPLACE "=" ";" pair ${entry})
    list(GET pair 0 link)
    list(GET pair 1 folder)
    get_filename_component(parent ${dir}/${link} DIRECTORY)
    file(MAKE_DIRECTORY ${parent})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${folder} ${dir}/${link} SYMBOLIC)
  endforeach()
endfunction()

set(DUET_LAYER_base        "base=src/base")
set(DUET_LAYER_kernels_cpu "kernels/cpu=kernels/cpu")
set(DUET_LAYER_kernels_cuda "kernels/cuda=kernels/cuda")
set(DUET_LAYER_shm         ${DUET_LAYER_base} "shm=shm")
set(DUET_LAYER_kv          ${DUET_LAYER_shm} ${DUET_LAYER_kernels_cpu} "kv=src/kv")
set(DUET_LAYER_model       ${DUET_LAYER_kv} "model=src/model")
if(DUET_CUDA)
  set(DUET_LAYER_cuda ${DUET_LAYER_model} ${DUET_LAYER_kernels_cuda} "cuda=src/cuda")
  set(DUET_LAYER_engine ${DUET_LAYER_cuda} "engine=src/engine")
else()
  set(DUET_LAYER_engine ${DUET_LAYER_model} "engine=src/engine")
endif()
set(DUET_LAYER_roles       ${DUET_LAYER_engine} "roles=src/roles")
set(DUET_LAYER_bench       ${DUET_LAYER_roles} "bench=bench")
set(DUET_LAYER_cli         ${DUET_LAYER_bench} "cli=src/cli")
foreach(layer base kernels_cpu kernels_cuda shm kv model cuda engine roles bench cli)
  if(DEFINED DUET_LAYER_${layer})
    duet_layer_view(${layer} ${DUET_LAYER_${layer}})
  endif()
endforeach()

# duet_layer(TARGET LAYER): TARGET compiles in LAYER's view, and so does whatever
# links it (the view only holds LAYER and the layers below).
function(duet_layer target layer)
  target_include_directories(${target} PUBLIC ${DUET_VIEWS}/${layer})
endfunction()

# duet_header_checks(LAYER LINK LIBS...): one translation unit per header of the
# folder that LAYER's view names LINK, compiled in LAYER's view with the usage
# requirements of LIBS (the layer's own libraries), in the default build.
option(DUET_HEADER_CHECKS "Compile each header of each layer on its own, in its layer's view" ON)
function(duet_header_checks layer link)
  if(NOT DUET_HEADER_CHECKS)
    return()
  endif()
  file(GLOB headers CONFIGURE_DEPENDS ${DUET_VIEWS}/${layer}/${link}/*.h)
  set(srcs)
  foreach(h ${headers})
    get_filename_component(name ${h} NAME_WE)
    get_filename_component(rel ${h} NAME)
    set(tu ${CMAKE_BINARY_DIR}/header-checks/${layer}/${name}.cpp)
    set(text "#include \"${link}/${rel}\"  // must compile alone, in the ${layer} layer's view\n")
    if(EXISTS ${tu})
      file(READ ${tu} old)
    endif()
    if(NOT old STREQUAL text)
      file(WRITE ${tu} "${text}")
    endif()
    list(APPEND srcs ${tu})
  endforeach()
  add_library(duet_header_checks_${layer} OBJECT ${srcs})
  target_compile_options(duet_header_checks_${layer} PRIVATE ${DUET_WARNINGS})
  target_include_directories(duet_header_checks_${layer} PRIVATE ${DUET_VIEWS}/${layer})
  foreach(lib ${ARGN})
    target_link_libraries(duet_header_checks_${layer} PRIVATE ${lib})
  endforeach()
endfunction()
