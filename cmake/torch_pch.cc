// The source of remotehead_torch_pch_library and remotehead_torch_pch_executable
// (cmake/RemoteheadPch.cmake): they exist to compile <torch/torch.h> once into the precompiled
// header every other target reuses.
