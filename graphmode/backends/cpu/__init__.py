"""CPU backend: generated C++ kernels for fused groups and slow single ops, tuned generated
GEMM/conv kernels or ATen/oneDNN, over one host arena per bucket (backend.py).

Layers, each importing only those before it:
  abi, cexpr, isa, attrs, tensors, lowering   the kernel ABI, C scalar expressions, the claim registry
  groups, emit, rowwise, codegen, epilogue    fused-group analysis and C++ generation
  gemm, conv, im2col, winograd                GEMM/conv kernel generators
  native, pool, movement, layout_kernels,    single-op lowerings (native kernels, ATen steps)
  resample, index_maps, group_norm,
  attention, aten, aten_out
  kernels, build                              compiling and loading kernel libraries
  catalog                                     every lowering registered
  tactics/                                    GEMM/conv candidates, timing + cache, selection
  binding, executor, backend                  binding a plan's steps; the executable; the Backend
"""
