// graphmode generated CPU kernels: the x86 intrinsics header, once per translation unit, for
// the kernels with per-ISA code paths. Included only where the compiler's own macros say
// AVX-512 or AVX2+FMA is on, with its mm_malloc.h guard pre-defined: that header's <stdlib.h>
// would clash with the prelude's own malloc/free declarations.

#ifndef GM_SIMD_H
#define GM_SIMD_H
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#ifndef _MM_MALLOC_H_INCLUDED
#define _MM_MALLOC_H_INCLUDED
#endif
#ifndef __MM_MALLOC_H
#define __MM_MALLOC_H
#endif
#include <immintrin.h>
#endif
#endif
