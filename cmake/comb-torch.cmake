# Defines comb::torch: LibTorch's headers and its CPU libraries (libtorch_cpu, libc10), nothing else.
#
# LibTorch's own CMake package is not used for this. For a CUDA build of LibTorch (the torch wheel
# is one) that package fails without a CUDA toolkit on the machine, and its `torch` target links
# libtorch_cuda into every program: about 320 MiB resident at start, CUDA or not. comb links the CPU
# libraries only and loads the CUDA ones at run time when a CUDA device is asked for
# (comb::load_cuda_backend). The CPU libraries need two small CUDA runtime libraries (libcudart,
# libcupti), which the set-up installs from their wheels beside torch.
#
# The LibTorch prefix (the folder holding include/ and lib/) is looked for in COMB_TORCH_PREFIX,
# TORCH_INSTALL_PREFIX (environment), Torch_DIR/../../.. and every CMAKE_PREFIX_PATH entry, both as
# given (a LibTorch folder) and two folders up (the wheel's torch.utils.cmake_prefix_path).
if(TARGET comb::torch)
  return()
endif()

set(_comb_torch_hints ${COMB_TORCH_PREFIX})
if(DEFINED ENV{TORCH_INSTALL_PREFIX})
  list(APPEND _comb_torch_hints "$ENV{TORCH_INSTALL_PREFIX}")
endif()
if(Torch_DIR)
  list(APPEND _comb_torch_hints "${Torch_DIR}/../../..")
endif()
foreach(_p IN LISTS CMAKE_PREFIX_PATH)
  list(APPEND _comb_torch_hints "${_p}" "${_p}/../..")
endforeach()

find_path(COMB_TORCH_INCLUDE_DIR torch/library.h HINTS ${_comb_torch_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
if(NOT COMB_TORCH_INCLUDE_DIR)
  message(FATAL_ERROR "comb: LibTorch not found (looked for include/torch/library.h under: ${_comb_torch_hints}). "
                      "Pass -DCMAKE_PREFIX_PATH=<LibTorch folder>, or the torch wheel's "
                      "`python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)'`.")
endif()
get_filename_component(COMB_TORCH_ROOT "${COMB_TORCH_INCLUDE_DIR}/.." ABSOLUTE)
find_library(COMB_TORCH_CPU_LIBRARY torch_cpu PATHS "${COMB_TORCH_ROOT}/lib" NO_DEFAULT_PATH)
find_library(COMB_C10_LIBRARY c10 PATHS "${COMB_TORCH_ROOT}/lib" NO_DEFAULT_PATH)
if(NOT COMB_TORCH_CPU_LIBRARY OR NOT COMB_C10_LIBRARY)
  message(FATAL_ERROR "comb: LibTorch at '${COMB_TORCH_ROOT}' lacks lib/libtorch_cpu.so or lib/libc10.so")
endif()

add_library(comb::torch INTERFACE IMPORTED)
set_target_properties(comb::torch PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "${COMB_TORCH_INCLUDE_DIR};${COMB_TORCH_INCLUDE_DIR}/torch/csrc/api/include"
  INTERFACE_LINK_LIBRARIES "${COMB_TORCH_CPU_LIBRARY};${COMB_C10_LIBRARY}"
  INTERFACE_COMPILE_FEATURES cxx_std_17)
# at::parallel_for is a template whose `#pragma omp parallel` is compiled into the code that calls
# it: without -fopenmp there, every comb kernel split with it runs on one thread. With GCC, comb's
# code is compiled with -fopenmp and linked to the OpenMP runtime LibTorch itself uses (the wheel's
# lib/libgomp.so.1 when it has one: one runtime, one thread pool, at::set_num_threads for both).
# Clang (the fuzz builds) emits libomp's calls for -fopenmp, not libgomp's: its builds stay serial.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  find_file(COMB_TORCH_GOMP libgomp.so.1 PATHS "${COMB_TORCH_ROOT}/lib" NO_DEFAULT_PATH)
  set_property(TARGET comb::torch APPEND PROPERTY INTERFACE_COMPILE_OPTIONS $<$<COMPILE_LANGUAGE:CXX>:-fopenmp>)
  if(COMB_TORCH_GOMP)
    set_property(TARGET comb::torch APPEND PROPERTY INTERFACE_LINK_LIBRARIES "${COMB_TORCH_GOMP}")
  else()
    set_property(TARGET comb::torch APPEND PROPERTY INTERFACE_LINK_LIBRARIES -fopenmp)
  endif()
endif()
unset(_comb_torch_hints)
