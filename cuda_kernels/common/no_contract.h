// MXF_NO_CONTRACT: a function compiled without floating-point contraction.
//
// Loops whose exact rounding matters (a product and a sum that MXNet rounds separately)
// are compiled without it: GCC would otherwise fuse a * s + t into one multiply-add, which
// rounds once and changes results (and overflows) bitwise.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define MXF_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define MXF_NO_CONTRACT
#endif
