# Unity builds of the project's multi-source targets (CMake's UNITY_BUILD, batches of 8).
#
# Loading the precompiled LibTorch header (cmake/RemoteheadPch.cmake) costs about 2 s a source
# and the templates each source instantiates are compiled again in every one of them: on 2 cores
# 8 of the server's sources took about 64 s one by one and 13-18 s as one unity unit. A unit
# holds the sources of one target in the order the target lists them; a source with its own
# compile definitions, options or include folders is compiled alone (CMake leaves it out).
#
# What unity asks of the code: no two sources of one target define the same name at namespace
# scope, anonymous namespaces included (a unit is one translation unit, so the second definition
# is an error, and a call could resolve to another source's helper). Shared helpers have one home
# in a header; file-local ones get names that say what they do. REMOTEHEAD_UNITY=OFF builds every
# source alone (the way to find which source a unit's error comes from).
option(REMOTEHEAD_UNITY "Compile the project's multi-source targets as unity units" ON)

# remotehead_unity_build(target...): the targets as unity units of 8 sources.
function(remotehead_unity_build)
  if(NOT REMOTEHEAD_UNITY)
    return()
  endif()
  foreach(target IN LISTS ARGN)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 8)
  endforeach()
endfunction()
