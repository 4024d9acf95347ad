#pragma once
//! \file Validation: a trainer's loss on held-out batches of a token source, as one number over
//! every target of every batch (Megatron-LM's --eval-iters, llm.c's val loss).

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>

#include "loom/core/error.hpp"
#include "loom/io/batch.hpp"

namespace loom {

//! Which batches of a source validation reads: batch_at(first + i, batch, seq) for i in
//! [0, batches). The same options give the same batches at every call, so losses taken at
//! different steps compare.
struct ValidationOptions {
  std::int64_t first = 0;    //!< the first batch index (a source's "step")
  std::int64_t batches = 1;  //!< how many batches
  std::int64_t batch = 1;    //!< sequences per batch: the trainer's global batch size works on any mesh
  std::int64_t seq = 1;      //!< tokens per sequence

  //! Refuses counts below 1 and a first index below 0, naming the value.
  void validate() const {
    LOOM_CHECK(first >= 0, "validation: first", first, "must be >= 0");
    LOOM_CHECK(batches >= 1, "validation: batches", batches, "must be >= 1");
    LOOM_CHECK(batch >= 1, "validation: batch", batch, "must be >= 1");
    LOOM_CHECK(seq >= 1, "validation: seq", seq, "must be >= 1");
  }
};

//! The result of validation_loss.
struct ValidationLoss {
  double loss = 0;            //!< mean loss over every counted target (nats per target)
  std::int64_t targets = 0;   //!< targets counted (those >= 0) over all batches
  std::int64_t batches = 0;   //!< batches that had at least one target (the others carry no loss)

  //! exp(loss): the perplexity of the held-out targets.
  double perplexity() const { return std::exp(loss); }
  friend std::ostream& operator<<(std::ostream& out, const ValidationLoss& v) {
    return out << "ValidationLoss{loss=" << v.loss << ", targets=" << v.targets << ", batches=" << v.batches
               << "}";
  }
};

//! The trainer's loss on `options.batches` batches of `source`, weighted by their targets: the
//! mean over all of them, as one batch holding every sequence would give (a padded or masked
//! batch with few targets counts for little). Forward only: parameters, optimizer state and the
//! step count stay as they were, and no dropout is drawn. Collective like Trainer::evaluate:
//! every rank of the mesh calls it with the same source and options, and every rank gets the
//! same result. A batch without targets is skipped on every rank alike; if no batch has one,
//! this throws.
template <class Trainer, io::TokenSource Source>
ValidationLoss validation_loss(Trainer& trainer, const Source& source, const ValidationOptions& options) {
  options.validate();
  double loss_sum = 0;
  ValidationLoss out;
  for (std::int64_t i = 0; i < options.batches; ++i) {
    const io::Batch b = source.batch_at(options.first + i, options.batch, options.seq);
    // The batch is the same on every rank, so every rank skips the same ones.
    const std::int64_t n = b.target_count();
    if (n == 0) continue;
    loss_sum += trainer.evaluate(b) * static_cast<double>(n);
    out.targets += n;
    ++out.batches;
  }
  LOOM_CHECK(out.targets > 0, "validation: targets", out.targets,
             "the " + detail::to_text(options.batches) + " batch(es) from index " + detail::to_text(options.first) +
                 " need at least one target >= 0 between them");
  out.loss = loss_sum / static_cast<double>(out.targets);
  return out;
}

}  // namespace loom
