// The source of the remotehead_torch_pch_* holders (cmake/RemoteheadPch.cmake): they exist to
// compile the project's LibTorch subset (and, for some, gRPC and GoogleTest) once into the
// precompiled header that every other target reuses.
