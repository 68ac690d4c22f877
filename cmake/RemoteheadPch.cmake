# One precompiled <torch/torch.h> for every target of the project that compiles against LibTorch.
#
# Parsing torch/torch.h is most of the cost of a translation unit here (8.7 s of the 14-24 s each
# of the ~200 took on 2 cores): the build, the GPU kit's, the image's and the fuzzers' each paid
# it once per source. The header is compiled once, in remotehead_torch_pch_*, and every target
# reuses that file (REUSE_FROM: same compiler flags and LibTorch definitions everywhere; GCC
# refuses a file built with other options, -Winvalid-pch makes that an error). Targets that do
# not link LibTorch (the generated protobuf code, a plain gRPC client) are left alone.
# REMOTEHEAD_PCH=OFF builds without it (each source then parses the headers it includes).
# (ccache caches sources compiled with a precompiled header given the sloppiness the top-level
# CMakeLists.txt sets in its launcher.)
option(REMOTEHEAD_PCH "Precompile <torch/torch.h> once and reuse it in every target" ON)

# Two copies of it: libraries compile position-independent code with -fPIC, executables with
# -fPIE (CMAKE_POSITION_INDEPENDENT_CODE), and GCC refuses a header precompiled with the other.
if(REMOTEHEAD_PCH)
  foreach(kind library executable)
    add_library(remotehead_torch_pch_${kind} OBJECT "${CMAKE_CURRENT_LIST_DIR}/torch_pch.cc")
    target_link_libraries(remotehead_torch_pch_${kind} PRIVATE remotehead::torch
                                                               remotehead_warnings)
    target_precompile_headers(remotehead_torch_pch_${kind} PRIVATE <torch/torch.h>)
  endforeach()
  set_target_properties(remotehead_torch_pch_executable PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_compile_options(remotehead_torch_pch_executable PRIVATE -fPIE)
endif()

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

# Every compiled target in `directory` and below that links LibTorch reuses the one precompiled
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
    if(type STREQUAL "EXECUTABLE")
      target_precompile_headers(${target} REUSE_FROM remotehead_torch_pch_executable)
    else()
      target_precompile_headers(${target} REUSE_FROM remotehead_torch_pch_library)
    endif()
  endforeach()
  get_property(subdirectories DIRECTORY "${directory}" PROPERTY SUBDIRECTORIES)
  foreach(subdirectory ${subdirectories})
    remotehead_reuse_torch_pch("${subdirectory}")
  endforeach()
endfunction()
