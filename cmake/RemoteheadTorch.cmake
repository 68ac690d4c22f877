# Finds LibTorch inside the pinned `torch` Python package and exposes it as `remotehead::torch`.
#
# The torch wheel ships an old copy of protobuf's headers in torch/include/google/protobuf.
# If torch's include directories came before the system's, generated .pb.h files (server, client)
# would pick them up and clash with Debian's protobuf. So torch's include directories are never
# added with -I/-isystem: they are removed from torch's imported targets and given to the
# compiler with -idirafter, which searches them after the system directories (and, like
# -isystem, silences warnings from them).
if(NOT REMOTEHEAD_PYTHON)
  find_program(REMOTEHEAD_PYTHON NAMES python3 REQUIRED)
endif()
execute_process(
  COMMAND "${REMOTEHEAD_PYTHON}" -c "import torch; print(torch.utils.cmake_prefix_path)"
  OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _torch_rc)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "remotehead: `${REMOTEHEAD_PYTHON}` cannot import torch; run scripts/bootstrap")
endif()
list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")

# The wheel is the CUDA build; the CUDA toolkit on the machine lets it configure without a GPU.
# Its CUDA libraries come from the wheel's nvidia/* packages (newer than the toolkit here):
# link and run against those, not the toolkit's, so one process never mixes two libcudart.
get_filename_component(_site_packages "${_torch_prefix}/../../.." ABSOLUTE)
file(GLOB _wheel_cuda_lib_dirs LIST_DIRECTORIES true "${_site_packages}/nvidia/*/lib")
foreach(_lib cudart nvrtc)
  file(GLOB _found "${_site_packages}/nvidia/*/lib/lib${_lib}.so.[0-9]*")
  if(_found)
    list(GET _found 0 _found)
    set(CUDA_${_lib}_LIBRARY "${_found}" CACHE FILEPATH "" FORCE)
  endif()
endforeach()
if(CUDA_cudart_LIBRARY)
  set(CUDA_CUDART "${CUDA_cudart_LIBRARY}" CACHE FILEPATH "" FORCE)
endif()
if(CUDA_nvrtc_LIBRARY)
  set(CUDA_NVRTC_LIB "${CUDA_nvrtc_LIBRARY}" CACHE FILEPATH "" FORCE)
endif()
if(NOT DEFINED TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
endif()
find_package(Torch REQUIRED)

get_filename_component(_torch_root "${_torch_prefix}/../.." ABSOLUTE)
set(_torch_include_dirs ${TORCH_INCLUDE_DIRS})
get_property(_imported DIRECTORY PROPERTY IMPORTED_TARGETS)
foreach(_t ${_imported})
  get_target_property(_dirs ${_t} INTERFACE_INCLUDE_DIRECTORIES)
  if(NOT _dirs)
    continue()
  endif()
  set(_kept "")
  foreach(_d ${_dirs})
    if(_d MATCHES "^${_torch_root}")
      list(APPEND _torch_include_dirs ${_d})
    else()
      list(APPEND _kept ${_d})
    endif()
  endforeach()
  set_target_properties(${_t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_kept}")
endforeach()
list(REMOVE_DUPLICATES _torch_include_dirs)

add_library(remotehead_torch INTERFACE)
add_library(remotehead::torch ALIAS remotehead_torch)
foreach(_d ${_torch_include_dirs})
  target_compile_options(remotehead_torch INTERFACE "-idirafter${_d}")
endforeach()
# The C++ runtime before LibTorch in every binary's search order: torch 2.11's libtorch.so
# exports a partial copy of std::filesystem (64 symbols; none from 2.12 on) whose remove_all
# jumps to a null pointer, and a library listed first wins the binary's lookups. So libstdc++ is
# made a needed library ahead of it (tests/core/torch_linkage_test.cc checks where the symbols
# come from).
target_link_libraries(remotehead_torch INTERFACE
  "-Wl,--push-state,--no-as-needed" stdc++ "-Wl,--pop-state" ${TORCH_LIBRARIES})
foreach(_d ${_wheel_cuda_lib_dirs})
  target_link_options(remotehead_torch INTERFACE "LINKER:-rpath-link,${_d}")
endforeach()
# Build-tree binaries find the wheel's CUDA libraries first (before the toolkit's in ld.so.cache).
set(CMAKE_BUILD_RPATH ${_wheel_cuda_lib_dirs} ${CMAKE_BUILD_RPATH})
if(TARGET torch_cuda)
  set(REMOTEHEAD_TORCH_HAS_CUDA ON)
  target_compile_definitions(remotehead_torch INTERFACE REMOTEHEAD_TORCH_HAS_CUDA=1)
endif()
# The torch range the project builds and passes against: from the GPU machine's 2.11 (CI builds
# and tests against it: tests/system/test_gpu_kit.py) to the pinned one (requirements.txt). An API
# that differs inside the range gets one seam here or in core/, never #ifs through the code.
set(REMOTEHEAD_TORCH_OLDEST 2.11)
if(Torch_VERSION VERSION_LESS REMOTEHEAD_TORCH_OLDEST)
  message(FATAL_ERROR "remotehead: LibTorch ${Torch_VERSION} from ${_torch_prefix} is older than "
                      "${REMOTEHEAD_TORCH_OLDEST}, the oldest torch remotehead builds against")
endif()
message(STATUS "remotehead: LibTorch ${Torch_VERSION} from ${_torch_prefix} (CUDA build: ${REMOTEHEAD_TORCH_HAS_CUDA})")
