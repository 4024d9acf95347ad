#pragma once
//! \file The Backend concept: where tensors live and how kernels run.

#include <concepts>
#include <cstddef>

#include "loom/core/memory.hpp"

namespace loom {

//! Kernels are overloads per backend type (`matmul_forward(const cpu&, ...)`). The namespace is
//! inline so that generic code (models, optimizers, strategies) calls them unqualified and
//! argument-dependent lookup on the backend type finds the overloads at instantiation, whichever
//! backend headers were included after the generic code.
inline namespace kernels {}

//! A Backend allocates accounted memory, moves bytes to and from the host, and is the first
//! argument of every kernel in `loom::kernels` (overloads per backend type). It opts in with
//! `using loom_backend = void;`. Backends are per-rank values: no process-wide state.
template <class B>
concept Backend = requires { typename B::loom_backend; } &&
                  requires(B& b, const B& cb, std::size_t bytes, void* p, const void* cp,
                           MemoryCategory c) {
                    { b.allocate(bytes, c) } -> std::same_as<void*>;
                    b.deallocate(p, bytes, c);
                    { cb.memory() } -> std::same_as<const MemoryTracker&>;
                    b.fill_zero(p, bytes);
                    b.copy_from_host(p, cp, bytes);
                    b.copy_to_host(p, cp, bytes);
                    b.synchronize();
                  };

//! Whether the host may read and write a backend's memory directly (the CPU's) or must copy
//! through `copy_to_host`/`copy_from_host` (a GPU's). A backend whose memory the host cannot
//! touch says so with `static constexpr bool device_memory = true;`.
template <Backend B>
inline constexpr bool host_addressable = !requires { requires B::device_memory; };

//! Whether a backend's attention kernels take dropout on the probabilities (AttentionDropout).
//! One whose kernels do not yet says so with `static constexpr bool attention_dropout = false;`,
//! and models refuse an attention dropout rate on it when they are built.
template <Backend B>
inline constexpr bool supports_attention_dropout = !requires { requires !B::attention_dropout; };

}  // namespace loom
