# The CUDA kernels of the engine (core/src/fused): compiled wherever nvcc is found and LibTorch is
# a CUDA build — every machine of this project, CI included, which runs none of them (their CPU
# twins are what CI tests). Sets REMOTEHEAD_CUDA_KERNELS_BUILT. REMOTEHEAD_CUDA_KERNELS=OFF leaves
# them out (the CPU image, which has no GPU to run them: docker/Dockerfile sets it in the
# environment, where the first configuration takes its default from).
set(_kernels_default ON)
if(DEFINED ENV{REMOTEHEAD_CUDA_KERNELS})
  set(_kernels_default $ENV{REMOTEHEAD_CUDA_KERNELS})
endif()
option(REMOTEHEAD_CUDA_KERNELS "Build the CUDA kernels when nvcc and a CUDA LibTorch are there"
       ${_kernels_default})
set(REMOTEHEAD_CUDA_KERNELS_BUILT OFF)
if(REMOTEHEAD_CUDA_KERNELS AND REMOTEHEAD_TORCH_HAS_CUDA AND NOT REMOTEHEAD_FUZZ)
  # Ampere (the A100s most trainers have) and Hopper with its architecture-specific features
  # (the H100 / H200 the project is lent); CUDAARCHS or -DCMAKE_CUDA_ARCHITECTURES override.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES "80;90a")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(CCACHE_PROGRAM)
      set(CMAKE_CUDA_COMPILER_LAUNCHER "${CCACHE_PROGRAM}")
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # what the kernels need; CMake 3.25 has no C++20 flag for nvcc
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(REMOTEHEAD_CUDA_KERNELS_BUILT ON)
  endif()
endif()
message(STATUS "remotehead: CUDA kernels built: ${REMOTEHEAD_CUDA_KERNELS_BUILT}")
