// Links the CUDA runtime, cuBLAS and cuBLASLt through loom::cuda; asks only for versions,
// which needs no GPU.
#include <loom/core/rng.hpp>

#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstdio>

int main() {
  int runtime = 0, cublas_major = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess || runtime <= 0 ||
      cublasGetProperty(MAJOR_VERSION, &cublas_major) != CUBLAS_STATUS_SUCCESS) {
    std::puts("loom cuda consumer: asking the CUDA libraries for their versions failed");
    return 1;
  }
  const loom::CounterRng rng(7, "consumer.cuda");
  std::printf("loom cuda consumer: ok (uniform %.3f; CUDA runtime %d, cuBLAS %d, cuBLASLt %zu)\n",
              rng.uniform(0), runtime, cublas_major, cublasLtGetVersion());
  return 0;
}
