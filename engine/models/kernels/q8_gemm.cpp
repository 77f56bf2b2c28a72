// The AVX-512 VNNI build of the int8 kernels: the tiles of q8_avx512.h, walked as q8_ops.h does.

#include "q8_avx512.h"
#include "q8_ops.h"
