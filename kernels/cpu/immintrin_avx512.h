// <immintrin.h> for the translation units compiled with AVX-512 (avx512.cpp,
// amx.cpp). GCC 12's AVX-512 headers initialise "undefined" vectors from
// themselves (`__m512 __Y = __Y;`), which -Wmaybe-uninitialized reports once
// inlined (GCC bug 105593, fixed in 13). The warning is about the header, not us.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
