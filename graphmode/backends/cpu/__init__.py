"""CPU backend: generated C++ kernels for fused groups, ATen/oneDNN for GEMM and conv."""
from graphmode.backends.cpu.build import KernelBuilder, compiler_available
from graphmode.backends.cpu.codegen import (ELEMENTWISE_OPS, GEMM_OPS, ROW_REDUCTIONS, KernelSource, generate,
                                            generate_all, split_gemm_epilogue, translation_unit)
from graphmode.backends.cpu.executor import CpuExecutable, KernelProvider
from graphmode.backends.cpu.kernels import CompiledKernel, CompiledLibrary, run_with_tensors

__all__ = ["KernelBuilder", "compiler_available", "ELEMENTWISE_OPS", "GEMM_OPS", "ROW_REDUCTIONS", "KernelSource",
           "generate", "generate_all", "split_gemm_epilogue", "translation_unit", "CpuExecutable",
           "KernelProvider", "CompiledKernel", "CompiledLibrary", "run_with_tensors"]
