#pragma once
//! \file cuBLASLt GEMMs with fused epilogues (bias, GELU, GELU gradient, bias gradient), planned
//! once per problem: the matmul descriptor, the three matrix layouts and the algorithm
//! cuBLASLt's heuristic picks are kept per key, so after a training step's first GEMMs no
//! heuristic query (tens of microseconds each) is made again.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "loom/backend/cuda/error.hpp"
#include "loom/core/error.hpp"

namespace loom::detail {

//! What a cuBLASLt GEMM's plan depends on: the column-major problem D = op(A) op(B) (operations,
//! extents, leading dimensions), the element types (of A and B, and of C, D and the bias vector)
//! and the compute type, the epilogue, the epilogue
//! matrix's leading dimension (0 when it has none), and the alignment every pointer shares
//! (cuBLASLt chooses kernels by alignment).
struct LtGemmKey {
  cublasOperation_t op_a, op_b;
  std::int64_t m, n, k, lda, ldb, ldc;
  cudaDataType_t data_type;    //!< A's and B's
  cudaDataType_t output_type;  //!< C's, D's and the bias vector's: data_type, or fp32 for fp32 sums
  cublasComputeType_t compute_type;
  cublasLtEpilogue_t epilogue;
  std::int64_t aux_ld;
  std::uint32_t alignment;  // bytes: 16, 8, 4 or 2
  friend bool operator==(const LtGemmKey&, const LtGemmKey&) = default;
};

struct LtGemmKeyHash {
  std::size_t operator()(const LtGemmKey& k) const noexcept {
    std::size_t h = 0;
    const auto mix = [&h](std::int64_t v) {
      h ^= std::hash<std::int64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    };
    for (const std::int64_t v : {std::int64_t{k.op_a}, std::int64_t{k.op_b}, k.m, k.n, k.k, k.lda, k.ldb, k.ldc,
                                 std::int64_t{k.data_type}, std::int64_t{k.output_type},
                                 std::int64_t{k.compute_type},
                                 std::int64_t{k.epilogue}, k.aux_ld, std::int64_t{k.alignment}})
      mix(v);
    return h;
  }
};

//! The epilogue pointers of one GEMM: `bias` is the bias read by CUBLASLT_EPILOGUE_BIAS, or the
//! bias gradient written by BGRADB; `aux` the GELU input, written by GELU_AUX and read by DGELU;
//! `addend` the matrix C of beta C where it is not D (D's layout; a residual added in the same
//! pass). Unused ones are null (no addend: C is D).
struct LtEpilogueOperands {
  const void* bias = nullptr;
  const void* aux = nullptr;
  const void* addend = nullptr;
};

//! One planned GEMM: its descriptors and the algorithm the heuristic chose, or found() false
//! when cuBLASLt has none for the problem (the caller then runs its unfused kernels).
class LtGemmPlan {
 public:
  //! Plans `key` on `handle`, allowing the algorithm up to `max_workspace` bytes of workspace.
  //! `operands` give the epilogue pointers' alignment to the heuristic.
  LtGemmPlan(cublasLtHandle_t handle, const LtGemmKey& key, LtEpilogueOperands operands,
             std::size_t max_workspace) {
    try {
      create(handle, key, operands, max_workspace);
    } catch (...) {
      release();
      throw;
    }
  }
  LtGemmPlan(const LtGemmPlan&) = delete;
  LtGemmPlan& operator=(const LtGemmPlan&) = delete;
  ~LtGemmPlan() { release(); }

  //! Whether cuBLASLt has an algorithm for the problem.
  bool found() const noexcept { return found_; }
  //! Workspace bytes the chosen algorithm needs.
  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }

  //! D = epilogue(op(A) op(B) + beta C) into `d` on `stream`, C being `operands.addend` or else D,
  //! with this call's epilogue pointers (the descriptor keeps the last ones; they must have the
  //! key's alignment).
  void run(cublasLtHandle_t handle, const void* a, const void* b, void* d, float beta, LtEpilogueOperands operands,
           void* workspace, cudaStream_t stream, const char* kernel) {
    if (operands.bias != nullptr) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, operands.bias);
    if (operands.aux != nullptr) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, operands.aux);
    const float alpha = 1.0f;
    const void* c = operands.addend != nullptr ? operands.addend : d;
    const cublasStatus_t status = cublasLtMatmul(handle, desc_, &alpha, a, a_, b, b_, &beta, c, c_, d, c_, &algo_,
                                                 workspace, workspace_bytes_, stream);
    if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]]
      cublas_check(status, (std::string(kernel) + ": cublasLtMatmul").c_str());
  }

 private:
  void create(cublasLtHandle_t handle, const LtGemmKey& key, LtEpilogueOperands operands,
              std::size_t max_workspace) {
    const cudaDataType_t scale_type = CUDA_R_32F;
    cublas_check(cublasLtMatmulDescCreate(&desc_, key.compute_type, scale_type), "cublasLtMatmulDescCreate");
    set(CUBLASLT_MATMUL_DESC_TRANSA, key.op_a);
    set(CUBLASLT_MATMUL_DESC_TRANSB, key.op_b);
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, key.epilogue);
    if (operands.bias != nullptr) {
      set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, key.output_type);
      set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, operands.bias);
    }
    if (operands.aux != nullptr) {
      set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, operands.aux);
      set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, key.aux_ld);
    }
    const bool a_rows = key.op_a == CUBLAS_OP_N, b_rows = key.op_b == CUBLAS_OP_N;
    layout(&a_, key.data_type, a_rows ? key.m : key.k, a_rows ? key.k : key.m, key.lda);
    layout(&b_, key.data_type, b_rows ? key.k : key.n, b_rows ? key.n : key.k, key.ldb);
    layout(&c_, key.output_type, key.m, key.n, key.ldc);

    cublasLtMatmulPreference_t preference = nullptr;
    cublas_check(cublasLtMatmulPreferenceCreate(&preference), "cublasLtMatmulPreferenceCreate");
    const std::uint64_t bytes = max_workspace;
    const std::uint32_t alignment = key.alignment;
    cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof bytes);
    for (const cublasLtMatmulPreferenceAttributes_t a :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulPreferenceSetAttribute(preference, a, &alignment, sizeof alignment);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(handle, desc_, a_, b_, c_, c_, preference, 1, &result, &found);
    (void)cublasLtMatmulPreferenceDestroy(preference);
    // NOT_SUPPORTED (or no result) means no kernel fuses this epilogue for this problem: the
    // caller's unfused path is the answer, not an error.
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) return;
    if (status != CUBLAS_STATUS_SUCCESS)
      cublas_check(status, ("cublasLtMatmulAlgoGetHeuristic(m = " + std::to_string(key.m) + ", n = " +
                        std::to_string(key.n) + ", k = " + std::to_string(key.k) + ")")
                           .c_str());
    algo_ = result.algo;
    workspace_bytes_ = result.workspaceSize;
    found_ = true;
  }
  template <class V>
  void set(cublasLtMatmulDescAttributes_t attribute, const V& value) {
    cublas_check(cublasLtMatmulDescSetAttribute(desc_, attribute, &value, sizeof value),
             "cublasLtMatmulDescSetAttribute");
  }
  void layout(cublasLtMatrixLayout_t* l, cudaDataType_t type, std::int64_t rows, std::int64_t cols,
              std::int64_t ld) {
    cublas_check(cublasLtMatrixLayoutCreate(l, type, static_cast<std::uint64_t>(rows),
                                            static_cast<std::uint64_t>(cols), ld),
                 "cublasLtMatrixLayoutCreate");
  }
  void release() noexcept {
    for (cublasLtMatrixLayout_t* l : {&a_, &b_, &c_})
      if (*l != nullptr) {
        (void)cublasLtMatrixLayoutDestroy(*l);
        *l = nullptr;
      }
    if (desc_ != nullptr) {
      (void)cublasLtMatmulDescDestroy(desc_);
      desc_ = nullptr;
    }
  }

  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  std::size_t workspace_bytes_ = 0;
  bool found_ = false;
};

//! How often the GEMMs that may fuse an epilogue did (fused) or fell back to separate kernels
//! (unfused: no cuBLASLt algorithm, or an epilogue matrix whose leading dimension cuBLASLt
//! refuses). Read by tests and benchmarks to know which path ran.
struct LtEpilogueCounts {
  std::int64_t fused = 0, unfused = 0;
};

//! A rank's cuBLASLt handle and its GEMM plans.
class LtGemms {
 public:
  //! The most workspace an algorithm may ask for: cuBLAS's recommendation for Hopper.
  static constexpr std::size_t max_workspace = std::size_t{32} << 20;

  LtGemms() { cublas_check(cublasLtCreate(&handle_), "cublasLtCreate"); }
  LtGemms(const LtGemms&) = delete;
  LtGemms& operator=(const LtGemms&) = delete;
  ~LtGemms() {
    plans_.clear();
    (void)cublasLtDestroy(handle_);
  }

  cublasLtHandle_t handle() const noexcept { return handle_; }
  //! The plan for `key`, made on first use.
  LtGemmPlan& plan(const LtGemmKey& key, LtEpilogueOperands operands) {
    auto it = plans_.find(key);
    if (it == plans_.end())
      it = plans_.emplace(key, std::make_unique<LtGemmPlan>(handle_, key, operands, max_workspace)).first;
    return *it->second;
  }
  //! How many problems have been planned.
  std::size_t plan_count() const noexcept { return plans_.size(); }
  LtEpilogueCounts& counts() noexcept { return counts_; }
  const LtEpilogueCounts& counts() const noexcept { return counts_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
  std::unordered_map<LtGemmKey, std::unique_ptr<LtGemmPlan>, LtGemmKeyHash> plans_;
  LtEpilogueCounts counts_;
};

}  // namespace loom::detail
