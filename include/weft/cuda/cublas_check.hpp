// WEFT_CUBLAS_CHECK: every cuBLAS call of weft (weft::hstu, the EP overlap benchmark) goes
// through it (weft::Error with the status's name and the call).
//
//   WEFT_CUBLAS_CHECK(cublasSetStream(handle, stream));
#pragma once

#include <cublas_v2.h>

#include "weft/core/error.hpp"

#define WEFT_CUBLAS_CHECK(expression)                                                  \
  do {                                                                                 \
    const cublasStatus_t weft_cublas_status_ = (expression);                           \
    if (weft_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                   \
      WEFT_FAIL("cuBLAS error ", cublasGetStatusName(weft_cublas_status_), " (",       \
                cublasGetStatusString(weft_cublas_status_), ") in ", #expression);     \
    }                                                                                  \
  } while (0)
