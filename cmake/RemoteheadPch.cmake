# One precompiled LibTorch header for every target of the project that compiles against LibTorch
# (with gRPC and GoogleTest in it for the targets that include those too).
#
# Parsing torch/torch.h was most of the cost of a translation unit here (8.7 s of the 14-24 s each
# of the ~200 took on 2 cores): the build, the GPU kit's, the image's and the fuzzers' each paid
# it once per source. The sources now include only the subset they use
# (remotehead/core/torch_api.h: loading it precompiled takes 2.0 s a source, all of torch.h
# 3.6 s). The header is compiled once, in remotehead_torch_pch_*, and every target
# reuses that file (REUSE_FROM: same compiler flags and LibTorch definitions everywhere; GCC
# refuses a file built with other options, -Winvalid-pch makes that an error). Targets that do
# not link LibTorch (the generated protobuf code, a plain gRPC client) are left alone.
# REMOTEHEAD_PCH=OFF builds without it (each source then parses the headers it includes).
# (ccache caches sources compiled with a precompiled header given the sloppiness the top-level
# CMakeLists.txt sets in its launcher.)
option(REMOTEHEAD_PCH "Precompile the LibTorch headers once and reuse them in every target" ON)

# remotehead_add_torch_pch(<kind> PIC|PIE [HEADERS h...] [LINK target...] [OPTIONS opt...]):
# the holder remotehead_torch_pch_<kind>, whose precompiled header is the project's LibTorch
# subset (remotehead/core/torch_api.h) and the HEADERS after it, compiled with the LINK targets'
# usage requirements and the OPTIONS. Position independence is part of it: libraries compile
# with -fPIC, executables with -fPIE (CMAKE_POSITION_INDEPENDENT_CODE), and GCC refuses a header
# precompiled with the other.
function(remotehead_add_torch_pch kind position)
  if(NOT REMOTEHEAD_PCH)
    return()
  endif()
  cmake_parse_arguments(PCH "" "" "HEADERS;LINK;OPTIONS" ${ARGN})
  set(holder remotehead_torch_pch_${kind})
  add_library(${holder} OBJECT "${REMOTEHEAD_PCH_SOURCE}")
  target_link_libraries(${holder} PRIVATE remotehead::torch remotehead_warnings ${PCH_LINK})
  target_precompile_headers(${holder} PRIVATE "${REMOTEHEAD_TORCH_API_HEADER}" ${PCH_HEADERS})
  target_compile_options(${holder} PRIVATE ${PCH_OPTIONS})
  if(position STREQUAL "PIE")
    set_target_properties(${holder} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${holder} PRIVATE -fPIE)
  endif()
endfunction()
set(REMOTEHEAD_PCH_SOURCE "${CMAKE_CURRENT_LIST_DIR}/torch_pch.cc")
# The parts of LibTorch the sources include (not all of <torch/torch.h>: see the header).
set(REMOTEHEAD_TORCH_API_HEADER "${PROJECT_SOURCE_DIR}/core/include/remotehead/core/torch_api.h")

# The two every LibTorch target can use. Two more are added where their headers come from:
# proto/ adds grpc_library (gRPC and the generated service headers too, for the libraries that
# speak gRPC) and tests/ adds test (GoogleTest as well, at the tests' optimisation level, for
# the executables it marks REMOTEHEAD_TEST_PCH).
remotehead_add_torch_pch(library PIC)
remotehead_add_torch_pch(executable PIE)

# TRUE in `out` when `target` links LibTorch (remotehead_torch), directly or through the
# project's own libraries.
function(_remotehead_links_torch target out)
  get_target_property(aliased ${target} ALIASED_TARGET)
  if(aliased)
    set(target ${aliased})
  endif()
  if(target STREQUAL "remotehead_torch")
    set(${out} TRUE PARENT_SCOPE)
    return()
  endif()
  get_target_property(imported ${target} IMPORTED)
  set(libraries "")
  if(NOT imported)
    get_target_property(type ${target} TYPE)
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(libraries ${target} LINK_LIBRARIES)
    endif()
    get_target_property(interface ${target} INTERFACE_LINK_LIBRARIES)
    list(APPEND libraries ${interface})
  endif()
  foreach(library ${libraries})
    if(TARGET "${library}")
      _remotehead_links_torch("${library}" found)
      if(found)
        set(${out} TRUE PARENT_SCOPE)
        return()
      endif()
    endif()
  endforeach()
  set(${out} FALSE PARENT_SCOPE)
endfunction()

# The holder `target` reuses: test executables (marked REMOTEHEAD_TEST_PCH by tests/) the test
# one, libraries that link gRPC's generated stubs (or the wire's gRPC part over them) the
# grpc_library one, others by their position independence. Where the richer holder is not
# defined the plain one serves: its headers are a subset, so the choice only saves parsing.
function(_remotehead_pch_holder target type out)
  get_target_property(test ${target} REMOTEHEAD_TEST_PCH)
  if(type STREQUAL "EXECUTABLE")
    if(test AND TARGET remotehead_torch_pch_test)
      set(${out} remotehead_torch_pch_test PARENT_SCOPE)
    else()
      set(${out} remotehead_torch_pch_executable PARENT_SCOPE)
    endif()
    return()
  endif()
  get_target_property(libraries ${target} LINK_LIBRARIES)
  if(TARGET remotehead_torch_pch_grpc_library AND
     ("remotehead::proto_grpc" IN_LIST libraries OR "remotehead_proto_grpc" IN_LIST libraries OR
      "remotehead::wire_grpc" IN_LIST libraries OR "remotehead_wire_grpc" IN_LIST libraries))
    set(${out} remotehead_torch_pch_grpc_library PARENT_SCOPE)
  else()
    set(${out} remotehead_torch_pch_library PARENT_SCOPE)
  endif()
endfunction()

# Every compiled target in `directory` and below that links LibTorch reuses one precompiled
# header. Called once, at the end of the top-level CMakeLists.txt.
function(remotehead_reuse_torch_pch directory)
  if(NOT REMOTEHEAD_PCH)
    return()
  endif()
  get_property(targets DIRECTORY "${directory}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target ${targets})
    get_target_property(type ${target} TYPE)
    if(target MATCHES "^remotehead_torch_pch_" OR
       NOT type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|OBJECT_LIBRARY)$")
      continue()
    endif()
    _remotehead_links_torch(${target} links_torch)
    if(NOT links_torch)
      continue()
    endif()
    _remotehead_pch_holder(${target} ${type} holder)
    target_precompile_headers(${target} REUSE_FROM ${holder})
  endforeach()
  get_property(subdirectories DIRECTORY "${directory}" PROPERTY SUBDIRECTORIES)
  foreach(subdirectory ${subdirectories})
    remotehead_reuse_torch_pch("${subdirectory}")
  endforeach()
endfunction()
