// The source of remotehead_torch_pch_library and _executable (cmake/RemoteheadPch.cmake): the target exists to compile
// <torch/torch.h> once into the precompiled header every other target reuses.
