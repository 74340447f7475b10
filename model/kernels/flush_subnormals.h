// FTZ and DAZ for a kernel's length, on whichever thread runs it: worker threads then round their fp32 operations
// as the engine's thread does (numerics.flush_subnormals), whatever their own MXCSR says.
#pragma once
#include <xmmintrin.h>

namespace linserve {

struct FlushSubnormals {
  unsigned int saved;
  FlushSubnormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
};

}  // namespace linserve
