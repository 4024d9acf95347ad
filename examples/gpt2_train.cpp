// gpt2_train: trains GPT-2 with loom, on one rank or on a DP x TP x PP mesh of several. Built
// with LOOM_EXAMPLE_BERT=1 the same program is bert_train: BERT on masked-LM batches, with every
// option below but --init and --save (bert_train --demo --dp 2 --tp 2, ...).
//
//   gpt2_train --demo                                   # the README demo: < 2 minutes on 2 cores
//   gpt2_train --model small --data tokens.bin --batch 8 --micro-batch 4 --seq 1024 --steps 100
//   gpt2_train --init gpt2_124M.bin --data tokens.bin --save tuned.bin --metrics run.jsonl
//   gpt2_train --data train.bin --val-data val.bin --eval-every 250   # held-out loss as it trains
//   gpt2_train --init-hf ./gpt2 --data tokens.bin --save-hf ./tuned  # Hugging Face directories
//   bert_train --init-hf ./bert-base-uncased --data tokens.bin --mask-token 103
//   gpt2_train --demo --dp 4                            # DDP over 4 thread ranks, one process
//   mpirun -n 2 gpt2_train --demo --comm mpi            # DDP over 2 MPI processes
//   gpt2_train --demo --dp 2 --zero 3                   # ZeRO-3 (FSDP FULL_SHARD) over 2 ranks
//   gpt2_train --demo --dp 4 --zero 3 --zero-replicas 2 # 2 copies, each sharded over 2 ranks (HSDP)
//   gpt2_train --demo --dp 2 --tp 2                     # 4 ranks: 2 replicas of a 2-way TP model
//   gpt2_train --demo --tp 2 --sequence-parallel        # the layernorms' rows split over the TP ranks too
//   gpt2_train --demo --pp 2                            # 2 pipeline stages, 1F1B
//   gpt2_train --demo --pp 2 --schedule interleaved --virtual-stages 2
//   gpt2_train --demo --device cuda --dp 2              # 2 ranks on the GPU(s) (gpt2_train_cuda.cu)
//
// One idea: a Trainer composed of a Model, an Optimizer, a Schedule and a Strategy runs a step on
// a global batch; every rank passes the same global batch and trains on its slice; everything
// printed comes from the step's metrics and the backends' memory reports (rank 0 prints).
// Schedule, strategy and optimizer are types: the command line picks one of a few
// instantiations (with_schedule, with_strategy, with_optimizer below).

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

#include "loom/backend/cpu/kernels.hpp"
#include "loom/comm/threads.hpp"
#if LOOM_EXAMPLE_WITH_MPI
#include "loom/comm/mpi.hpp"
#endif
#include "gpt2_train.hpp"

#if !LOOM_EXAMPLE_BERT
#include <chrono>
#include <optional>
#include <string_view>

#include "loom/io/token_decoder.hpp"
#include "loom/models/gpt2/generate.hpp"

namespace gpt2_example {

namespace {
//! Bytes as text, with control bytes other than newline and tab escaped (\xNN).
std::string printable(std::string_view bytes) {
  std::string out;
  for (const unsigned char b : bytes) {
    if (b == '\n' || b == '\t' || (b >= 32 && b != 127)) out.push_back(static_cast<char>(b));
    else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned>(b));
      out += hex;
    }
  }
  return out;
}
}  // namespace

//! --tokenizer, checked before any rank starts: token data (bytes: data prints as text already),
//! a file that reads, and a vocabulary that covers every id the model can generate.
void check_tokenizer(const Options& o) {
  if (o.data.starts_with("bytes:"))
    throw loom::Error("--tokenizer", o.tokenizer,
                      "bytes: data prints its samples as text already; a tokenizer decodes token data");
  const loom::io::TokenDecoder decoder = loom::io::TokenDecoder::read(o.tokenizer);
  const std::int64_t vocab = model_config(o).vocab_size;
  LOOM_CHECK(decoder.size() >= vocab, "--tokenizer " + o.tokenizer + ": tokens", decoder.size(),
             "must cover the model's vocab_size (" + std::to_string(vocab) + "): every id it can generate");
}

void print_sample(const Options& o, std::int64_t after_step, int threads, const family::Config& config,
                  std::span<const float> whole, const Source& data) {
  loom::cpu backend(threads);
  const loom::gpt2::Model<loom::cpu, float> model(config);
  LOOM_CHECK(model.layout().total() == static_cast<std::int64_t>(whole.size()), "--sample-tokens: weights",
             whole.size(), "must fill the one-rank model's layout (" + std::to_string(model.layout().total()) + ")");
  loom::gpt2::Generator<loom::cpu, float> generator(backend, model, loom::ParameterView<const float>(whole.data()));
  const std::vector<std::int32_t> prompt = prompt_tokens(o, data);
  // Read again for each sample: it was checked before the first step, and is small.
  const std::optional<loom::io::TokenDecoder> decoder =
      o.tokenizer.empty() ? std::nullopt : std::optional(loom::io::TokenDecoder::read(o.tokenizer));
  const loom::gpt2::SamplingOptions options{.max_new_tokens = o.sample_tokens,
                                            .temperature = o.temperature,
                                            .top_k = o.top_k,
                                            .seed = o.seed,
                                            .stop_token = decoder ? decoder->end_of_text() : -1};
  const auto begin = std::chrono::steady_clock::now();
  const std::vector<std::vector<std::int32_t>> texts =
      generator.generate_batch(std::vector<std::vector<std::int32_t>>(static_cast<std::size_t>(o.samples), prompt), options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  if (o.samples == 1)
    std::printf("sample after step %lld: %zu tokens after the prompt's %zu, temperature %g, top-k %lld, seed %llu "
                "(%.2f s on the CPU, key/value cache):\n",
                static_cast<long long>(after_step), texts[0].size() - prompt.size(), prompt.size(), o.temperature,
                static_cast<long long>(o.top_k), static_cast<unsigned long long>(o.seed), seconds);
  else
    std::printf("sample after step %lld: %lld texts of up to %lld tokens after the prompt's %zu, temperature %g, top-k "
                "%lld, seed %llu (%.2f s on the CPU, key/value cache, generated together):\n",
                static_cast<long long>(after_step), static_cast<long long>(o.samples),
                static_cast<long long>(o.sample_tokens), prompt.size(), o.temperature, static_cast<long long>(o.top_k),
                static_cast<unsigned long long>(o.seed), seconds);
  for (std::size_t k = 0; k < texts.size(); ++k) {
    const std::vector<std::int32_t>& text = texts[k];
    if (o.samples > 1) std::printf("[%zu] ", k + 1);
    if (o.data.starts_with("bytes:")) {
      std::printf("%s\n", printable(std::string(text.begin(), text.end())).c_str());
    } else if (decoder) {
      std::printf("%s\n", printable(decoder->decode(text)).c_str());
    } else {
      for (std::size_t i = 0; i < text.size(); ++i) std::printf("%s%d", i == 0 ? "" : i == prompt.size() ? " | " : " ", text[i]);
      std::printf("\n");
    }
  }
  std::fflush(stdout);
}

}  // namespace gpt2_example
#endif

namespace {

using gpt2_example::Options;

//! Trains on the CPU backend: one rank, thread ranks, or MPI processes.
int run_cpu(const Options& o, int& argc, char**& argv) {
  using gpt2_example::train_on;
  const int cores = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (o.comm == "mpi") {
#if LOOM_EXAMPLE_WITH_MPI
    return loom::mpi::run(argc, argv, [&](loom::mpi::Communicator& world) {
      gpt2_example::check_mpi_world(o, world.size());
      // Each process uses --threads (0 = every core of its machine).
      loom::cpu backend(o.threads);
      return gpt2_example::mpi_status(train_on(o, backend, world));
    });
#else
    throw loom::Error("--comm", o.comm, std::string("this ") + gpt2_example::program + " was built without MPI (install libopenmpi-dev and rebuild)");
#endif
  }
  const int ranks = o.dp * o.tp * o.pp;
  if (ranks == 1) {
    loom::SelfCommunicator self;
    loom::cpu backend(o.threads);
    return train_on(o, backend, self);
  }
  // Thread ranks share the cores: each gets its share of --threads (at least one).
  const int per_rank = std::max(1, cores / ranks);
  int code = 0;
  loom::threads::run(ranks, [&](loom::threads::Communicator& comm) {
    loom::cpu backend(per_rank);
    const int c = train_on(o, backend, comm);
    if (comm.rank() == 0) code = c;
  });
  return code;
}

}  // namespace

#if !LOOM_EXAMPLE_WITH_CUDA
int gpt2_example::run_cuda(const Options&, int&, char**&) {
  throw loom::Error("--device", "cuda",
                    std::string("this ") + gpt2_example::program + " was built without CUDA (it needs the CUDA toolkit and CMake's CUDA "
                    "language: LOOM_ENABLE_CUDA=ON)");
}
#endif

int main(int argc, char** argv) {
  Options o;
#if LOOM_EXAMPLE_BERT
  constexpr const char* model_name = "BERT";
  constexpr const char* configs = "Config: tiny, base (110M), large (340M)";
#else
  constexpr const char* model_name = "GPT-2";
  constexpr const char* configs = "Config: tiny, small (124M), medium (350M), large (774M), xl (1.5B), 2.7B";
#endif
  CLI::App app{std::string("Train ") + model_name +
               " with loom on the CPU or on GPUs: one rank, or a DP x TP x PP mesh of thread or MPI ranks."};
  app.add_flag("--demo", o.demo,
               std::string("The README demo: a 4-layer, 128-channel ") + model_name + " on the synthetic task; finishes in "
               "under 2 minutes on 2 cores. Other options given after it still apply.");
  app.add_option("--model", o.model, configs)
      ->capture_default_str();
  app.add_option("--layers", o.layers, "Override the config's number of layers");
  app.add_option("--heads", o.heads, "Override the config's number of heads");
  app.add_option("--channels", o.channels, "Override the config's hidden size");
  app.add_option("--vocab-size", o.vocab_size,
                 "Override the config's vocabulary (wte's rows rounded up to 128): a token file of a larger "
                 "tokenizer's ids, cl100k_base's 100277 or Llama 3's 128256, say");
  app.add_option("--steps", o.steps, "Optimizer steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "Sequences per global batch")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--micro-batch", o.micro_batch,
                 "Sequences per micro-batch; the batch is accumulated over batch/micro-batch of them (0 = each "
                 "rank's whole slice, or 2 x pp micro-batches per pipeline under a pipeline schedule)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--accumulation", o.accumulation,
                 "Micro-batches per step on each rank (each pipeline with --pp); sets --batch to micro-batch x accumulation x ranks (0 = from --batch)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--seq", o.seq, "Tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "Peak learning rate")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", o.warmup, "Linear warmup steps from 0")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--min-lr-factor", o.min_lr_factor, "The decay ends at this fraction of --lr (inverse-sqrt: never goes below it)")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_option("--lr-decay", o.lr_decay,
                 "After the warmup: cosine, linear (BERT's), constant, inverse-sqrt (lr x sqrt(warmup/step)) or wsd "
                 "(warmup-stable-decay: constant, then a cooldown over the last --wsd-decay-steps)")
      ->capture_default_str()->check(CLI::IsMember({"cosine", "linear", "constant", "inverse-sqrt", "wsd"}));
  app.add_option("--lr-decay-steps", o.lr_decay_steps,
                 "The step the decay ends at, constant after (Megatron-LM's --lr-decay-iters; 0 = --steps)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--wsd-decay-steps", o.wsd_decay_steps,
                 "--lr-decay wsd: the cooldown's length in steps (0 = a fifth of the steps after the warmup)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--wsd-cooldown", o.wsd_cooldown, "--lr-decay wsd: the cooldown's shape: linear, cosine or 1-sqrt")
      ->capture_default_str()->check(CLI::IsMember({"linear", "cosine", "1-sqrt"}));
  app.add_option("--clip", o.clip, "Clip the global gradient norm to this (0 = off)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--optimizer", o.optimizer,
                 "adamw, sgd (momentum 0.9; float only) or adafactor (factored second moments, update clipping, "
                 "relative step: --lr caps the step, try 1e-2)")
      ->capture_default_str()->check(CLI::IsMember({"adamw", "sgd", "adafactor"}));
  app.add_option("--adam-beta1", o.adam.beta1, "AdamW's first-moment decay")->capture_default_str();
  app.add_option("--adam-beta2", o.adam.beta2,
                 "AdamW's second-moment decay (0.95 as GPT-3 and llm.c; BERT and PyTorch's default: 0.999)")
      ->capture_default_str();
  app.add_option("--adam-eps", o.adam.eps, "AdamW's epsilon (BERT: 1e-6)")->capture_default_str();
  app.add_option("--dtype", o.dtype,
                 "float, or bf16: parameters, gradients and activations in bf16, fp32 arithmetic, "
                 "master weights and optimizer state (mixed precision; adamw or adafactor)")
      ->capture_default_str()->check(CLI::IsMember({"float", "bf16"}));
  app.add_flag("--fp32-gradients", o.fp32_gradients,
               "With --dtype bf16: add the micro-batches' gradients up, all-reduce and clip them in fp32 (Megatron-LM's "
               "--accumulate-allreduce-grads-in-fp32), not in bf16; the fp32 sums replace the bf16 gradients (2 more "
               "bytes a parameter under DDP), twice the all-reduce bytes. Every strategy and schedule");
  app.add_flag("--no-fp32-gradient-fusion", o.no_fp32_gradient_fusion,
               "With --fp32-gradients: the layers write bf16 gradients that are then added to the fp32 sums "
               "(drained) after each layer, instead of adding to the fp32 sums directly (Megatron-LM's "
               "gradient-accumulation fusion, the default; the bf16 gradients then need 2 more bytes a parameter); "
               "for comparisons");
  app.add_flag("--no-stop-on-non-finite", o.no_stop_on_non_finite,
               "Apply a step whose loss or gradient norm is NaN or infinite, as PyTorch does, instead of stopping the "
               "run there with the model of the step before (TrainerOptions::stop_on_non_finite, Megatron-LM's "
               "check for NaN in the loss and gradients)");
  app.add_option("--attention", o.attention,
                 "stored: keep the attention probabilities (B x heads x seq^2 per block) for the backward; "
                 "recompute: keep each row's log-sum-exp and recompute them in the backward (one more GEMM); "
                 "auto: recompute where the tiled (flash) kernels run it (--device cuda, --dtype bf16, sm_80 or "
                 "newer, head size 32, 64 or 128; padding and attention dropout included), else stored")
      ->capture_default_str()->check(CLI::IsMember({"stored", "recompute", "auto"}));
  app.add_option("--recompute-layers", o.recompute_layers,
                 "Full activation recomputation: in each pipeline chunk, the first N layers that keep activations "
                 "(the loss layer excepted) keep only their input and run their forward again in the backward "
                 "(Megatron-LM's --recompute-method block); a count, or all. Same model, about one more forward "
                 "of time, activations of one layer instead of N")
      ->capture_default_str();
  app.add_option("--logits-chunk-rows", o.logits_chunk_rows,
                 "The head computes the logits and the loss this many rows at a time and keeps 3 doubles a row "
                 "instead of its probabilities (vocabulary/tp values a row); its backward computes each chunk again "
                 "(one more unembedding GEMM). 0 = keep the probabilities")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
#if LOOM_EXAMPLE_BERT
  app.add_flag("--logits-at-every-position", o.logits_at_every_position,
               "Run the masked-LM head (transform, logits, loss) on every position, as Megatron-LM and Hugging "
               "Face do, instead of only on the ~15% that carry a target (the default, as BERT's reference code): "
               "the same model, about 6x the head's work; for comparisons");
  app.add_option("--max-predictions", o.max_predictions,
                 "At most this many predicted positions a sequence, in the masked-LM data and in the model's "
                 "head, which then keeps room for batch x this many rows of logits instead of batch x seq "
                 "(BERT's max_predictions_per_seq: 20 at seq 128, 80 at 512). 0 = no cap")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
#endif
  app.add_flag("--flash-attention,!--no-flash-attention", o.flash_attention,
               "--device cuda with --dtype bf16 --attention recompute: the SRAM-tiled attention kernels (the "
               "default; the fastest on an H100), or with --no-flash-attention the cuBLAS batched-GEMM ones");
  app.add_flag("--warpgroup-attention", o.warpgroup_attention,
               "--device cuda: the tiled attention kernels at head size 64 multiply with Hopper's wgmma (a build "
               "for sm_90a: -DCMAKE_CUDA_ARCHITECTURES=90a) instead of each warp's mma.sync");
  // Unset by default (on for bf16, off for float): the flag goes through a plain bool, since CLI11
  // would give an optional its default, false, and the option's count says whether it was given.
  bool gemm_epilogues = false;
  CLI::Option* gemm_epilogues_flag = app.add_flag("--gemm-epilogues,!--no-gemm-epilogues", gemm_epilogues,
               "--device cuda: fuse the linear layers' bias and bias gradient, the MLP's GELU and its "
               "gradient into the cuBLASLt GEMMs (the default with --dtype bf16), or run them as separate "
               "kernels (the default with --dtype float: cuBLASLt's GELU is an approximation to about 2^-9)");
  app.add_option("--dropout", o.hidden_dropout,
                 "Dropout on the embedding's output and on each block's attention and MLP branches (the "
                 "config's hidden_dropout; masks keyed by seed, step, layer and global position, so every mesh "
                 "drops the same elements); 0 = none")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--attention-dropout", o.attention_dropout,
                 "Dropout on the attention probabilities (with --device cuda the tiled bf16 attention "
                 "kernels give way to the cuBLAS ones); 0 = none")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--weight-decay", o.weight_decay, "Weight decay on matrices and embeddings")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--seed", o.seed, "Seed of the initial weights (and of the synthetic data)")->capture_default_str();
  app.add_option("--data", o.data,
                 "synthetic (a Markov chain over the model's own vocabulary), an llm.c token file (uint16, magic "
                 "20240520; or uint32, magic 20240801), or bytes:FILE (any file, vocab 256)")
      ->capture_default_str();
  app.add_option("--jump-probability", o.jump_probability, "Synthetic task: chance a token breaks the chain")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_option("--pad-min", o.pad_min,
                 "Sequences of lengths drawn from [N, seq], padded to seq; no query attends to the padding and it "
                 "carries no target (0: every sequence full-length)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--pad-token", o.pad_token, "The token id padded positions read (with --pad-min)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--metrics", o.metrics,
                 "Write one JSON object per step to this file (JSON Lines); with --val-data, val_loss where it "
                 "was taken, and a first line with the loss before the first step");
  app.add_option("--val-data", o.val_data,
                 "Held-out data for a validation loss (forward only, no dropout, the same batches each time): an "
                 "llm.c token file or bytes:FILE, read from its start; or synthetic (with --data synthetic): the "
                 "task's sequences after the run's last step, which training never reads. Padded and masked as "
                 "--data is");
  app.add_option("--eval-every", o.eval_every,
                 "With --val-data: the validation loss every N steps, besides before the first step and after the "
                 "last (0 = only those two)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--eval-batches", o.eval_batches,
                 "With --val-data: batches of --batch sequences each validation reads (the loss is the mean over "
                 "all their targets)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--mask-token", o.mask_token,
                 "bert_train: the data's [MASK] token id (a token file needs it; synthetic and bytes: data "
                 "get a new id after their vocabulary)");
  app.add_option("--sample-tokens", o.sample_tokens,
                 "gpt2_train: after training, generate this many tokens on the CPU from the trained weights and "
                 "print them (text with bytes: data, token ids otherwise); 0 = none")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--sample-every", o.sample_every,
                 "With --sample-tokens: also sample after every N steps, with the same draws each time (0 = after "
                 "the last step only)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--samples", o.samples,
                 "With --sample-tokens: this many texts from the same prompt, each with its own draws, generated "
                 "together (each step's GEMMs read the weights once for all)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--prompt", o.prompt,
                 "With --sample-tokens: what the sample follows: text with bytes: data or with --tokenizer, token "
                 "ids separated by commas otherwise (default: the data's first token)");
  app.add_option("--tokenizer", o.tokenizer,
                 "With --sample-tokens and token data: print the sample as text, decoded through llm.c's "
                 "tokenizer file (gpt2_tokenizer.bin), a Hugging Face vocab.json (ids in merge order) or a Hugging "
                 "Face tokenizer.json of a byte-level BPE, and read --prompt as text encoded through it; generation "
                 "stops at its end-of-text token (<|endoftext|>, else </s>)");
  app.add_option("--temperature", o.temperature, "With --sample-tokens: divides the logits (0 = greedy)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", o.top_k, "With --sample-tokens: draw among the k most likely tokens (0 = all)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--init", o.init, "Start from an llm.c GPT-2 checkpoint (its header sets the model config)");
  app.add_option("--save", o.save, "Write the trained weights as an llm.c checkpoint");
  app.add_option("--init-hf", o.init_hf,
                 "Start from a Hugging Face model: the directory save_pretrained writes (config.json and "
                 "model.safetensors), or its .safetensors file; its config sets the model, the flags set dropout");
  app.add_option("--save-hf", o.save_hf,
                 "Write the trained weights to this directory as a Hugging Face model (config.json, "
                 "model.safetensors) that transformers' from_pretrained loads");
  app.add_option("--gelu", o.gelu,
                 "The MLP's GELU: tanh (the approximation GPT-2 uses) or erf (the exact form BERT uses); default: "
                 "tanh, or what the --init-hf config says")
      ->check(CLI::IsMember({"tanh", "erf"}));
  app.add_option("--save-state", o.save_state,
                 "Write a loom training-state checkpoint (parameters, optimizer state, steps done) at the end, "
                 "and every --save-every steps; any mesh and strategy can --resume it. A name holding {step} "
                 "(ckpt/step{step}.state) keeps one file per save, the step zero-padded to 8 digits");
  app.add_flag("--async-save", o.async_save,
               "With --save-every: write those saves in the background while training goes on (each rank copies "
               "its part of the state into host memory, which it keeps for the next save); the save at the end, or "
               "at a signal or time limit, still waits");
  app.add_option("--keep-last", o.keep_last,
                 "With a --save-state holding {step}: after each save, delete the series' files but the newest N "
                 "(0 = keep all)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--save-every", o.save_every, "With --save-state: also save it after every N steps (0 = at the end only)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--resume", o.resume,
                 "Go on from a training-state checkpoint (--save-state) of the same model, optimizer and "
                 "data options: its steps are done, the run continues to --steps. A name holding {step} "
                 "goes on from the series' file of the highest step, passing over damaged newer ones (renamed NAME.corrupt)");
  CLI::Option* check_state_option = app.add_option(
      "--check-state", o.check_state,
      "Check a training-state file, or every file of a series (a name holding {step}), whole: read it and compare "
      "every checksum, print a line per file, exit 1 if any is corrupt. Trains nothing; give it alone");
  app.add_flag("--resume-if-exists", o.resume_if_exists,
               "With --resume: start at step 1 when its file does not exist (yet), so that one command line with "
               "--save-state and --resume of the same file starts a run and, run again after a stop, goes on with it");
  app.add_option("--stop-after", o.stop_after,
                 "Stop after this step (0 = at --steps) while the learning-rate schedule still spans --steps: "
                 "a run cut short on purpose, to --resume later")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--stop-after-minutes", o.stop_after_minutes,
                 "Stop before the step that would end past this many minutes from the start (each step taken "
                 "to last as long as the one before), saving --save-state: a run that fits a job's time limit, to "
                 "--resume later (Megatron-LM's --exit-duration-in-mins)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-save-on-signal", o.no_save_on_signal,
               "With --save-state: let SIGINT, SIGTERM and SIGUSR1 end the process at once. By default the first "
               "one stops the run after the step under way, on every rank, and saves the training state (a second "
               "one ends it at once); the exit status is then 128 + the signal's number");
  app.add_option("--threads", o.threads, "CPU threads (0 = all cores)")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--peak-tflops", o.peak_tflops, "The machine's peak TFLOP/s, to print MFU")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--log-every", o.log_every, "Print every N steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--dp", o.dp,
                 "Data-parallel ranks (DDP). With --comm threads: thread ranks in this process, sharing "
                 "--threads; with --comm mpi: must equal the MPI world size (or be left at 1 to take it)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--tp", o.tp,
                 "Tensor-parallel ranks per model replica (Megatron's split; heads, channels and the padded "
                 "vocabulary must divide by it). Ranks = dp x tp x pp")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--sequence-parallel", o.sequence_parallel,
               "With --tp > 1: split the hidden state's rows between the layers over the tensor-parallel "
               "ranks too (Megatron-LM's --sequence-parallel): layernorms, dropout and residuals on 1/tp of the "
               "tokens, reduce-scatter and all-gather in place of the all-reduces; micro-batch x seq must divide "
               "by --tp");
  app.add_option("--pp", o.pp,
                 "Pipeline stages: the model's layers (embedding, blocks, head) split into pp contiguous "
                 "stages balanced by cost. Ranks = dp x tp x pp")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--schedule", o.schedule,
                 "Micro-batch schedule: accumulation (one stage; the default without --pp), gpipe, "
                 "1f1b (the default with --pp > 1), interleaved (virtual stages), zb-h1 (zero bubble)")
      ->check(CLI::IsMember({"accumulation", "gpipe", "1f1b", "interleaved", "zb-h1"}));
  app.add_option("--virtual-stages", o.virtual_stages,
                 "--schedule interleaved: model chunks per pipeline rank (default 2); pp x this must not "
                 "exceed the model's layers, and micro-batches per pipeline must divide by pp")
      ->check(CLI::PositiveNumber);
  app.add_option("--device", o.device,
                 "cpu, or cuda: each rank on a GPU (thread ranks take GPUs round robin and may share one)")
      ->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--gpus", o.gpus, "--device cuda with thread ranks: GPUs to use (0 = every GPU)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--comm", o.comm,
                 "Communicator: threads (ranks as threads), mpi (run under mpirun); with --device cuda also "
                 "nccl (thread ranks, NCCL between their GPUs, one GPU each) or mpi-nccl (MPI processes, "
                 "NCCL between their GPUs). threads and mpi move GPU buffers through host memory")
      ->capture_default_str()->check(CLI::IsMember({"threads", "mpi", "nccl", "mpi-nccl"}));
  app.add_option("--bucket-mib", o.bucket_mib, "DDP gradient bucket size in MiB")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--no-overlap", o.no_overlap, "DDP/ZeRO: reduce all buckets after backward instead of during it");
  app.add_flag("!--no-communication-stream", o.communication_stream,
               "--device cuda --comm nccl: issue NCCL calls on the compute stream, where each one holds up the "
               "kernels issued after it, instead of on a stream of their own beside them (the default)");
  app.add_option("--zero", o.zero,
                 "ZeRO stage over the data-parallel ranks: 1 (optimizer state sharded), 2 (+ gradients), "
                 "3 (+ parameters, gathered per layer); 0 = DDP. Pipeline schedules take 0 or 1")
      ->capture_default_str()->check(CLI::Range(0, 3));
  app.add_option("--prefetch", o.prefetch, "ZeRO-3: layers whose parameters are gathered ahead")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--zero-replicas", o.zero_replicas,
                 "ZeRO: hybrid sharding (FSDP's HYBRID_SHARD). The data-parallel ranks hold this many copies of "
                 "the model, each sharded over --dp / R adjacent ranks; gathers and reduce-scatters stay within "
                 "a copy, and the copies all-reduce their shards' gradients during the backward (after it with --no-overlap)")
      ->capture_default_str()->check(CLI::PositiveNumber);

  // --demo sets defaults first; explicit options on the command line win.
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--demo") {
      o.model = "tiny";
      o.layers = 4;
      o.heads = 4;
      o.channels = 128;
      o.steps = 300;
      o.batch = 16;
      o.seq = 64;
      o.lr = 3e-3;
      o.warmup = 20;
      o.log_every = 10;
    }
  CLI11_PARSE(app, argc, argv);
  if (gemm_epilogues_flag->count() > 0) o.gemm_epilogues = gemm_epilogues;
  if (o.accumulation > 0 && o.micro_batch > 0 && !app.count("--batch"))
    o.batch = o.micro_batch * o.accumulation * (o.comm == "threads" ? o.dp : 1);
  try {
    if (!o.check_state.empty()) {
      // A mode of its own: every other option would change nothing, and is refused.
      for (const CLI::Option* option : app.get_options())
        if (option != check_state_option && option->count() > 0)
          throw loom::Error("--check-state", o.check_state,
                            "it checks files and trains nothing, so " + option->get_name() +
                                " would change nothing: give --check-state alone");
      return gpt2_example::check_state_files(o.check_state);
    }
    if (o.schedule.empty()) o.schedule = o.pp > 1 ? "1f1b" : "accumulation";
    // Rejected here, before any rank starts: the library rejects these at compile time, so
    // gpt2_train has no such Trainer to let fail.
    if (o.virtual_stages && o.schedule != "interleaved")
      throw loom::Error("--virtual-stages", std::to_string(*o.virtual_stages),
                        "only --schedule interleaved has virtual stages (the schedule is " + o.schedule + ")");
    if (o.dp % o.zero_replicas != 0)
      throw loom::Error("--zero-replicas", std::to_string(o.zero_replicas),
                        "must divide --dp (" + std::to_string(o.dp) +
                            "): each replica shards the model over --dp / --zero-replicas ranks");
    gpt2_example::check_family_options(o);
    // A flag that would change nothing in this run is refused, not ignored: whoever gave it meant
    // something this run would not do. A flag's value is named; a switch is named as given (--no-X
    // is X's option).
    const auto refuse_inert = [&](const char* flag, bool inert, const std::string& rule) {
      if (!inert || app.count(flag) == 0) return;
      const CLI::Option* option = app.get_option(flag);
      if (option->get_expected_min() != 0) throw loom::Error(flag, option->as<std::string>(), rule);
      std::string given = flag;
      for (int i = 1; i < argc; ++i)
        if (option->check_name(argv[i])) given = argv[i];
      throw loom::Error(given, "", rule);
    };
    for (const char* flag : {"--gpus", "--flash-attention", "--warpgroup-attention", "--gemm-epilogues",
                             "--no-communication-stream"})
      refuse_inert(flag, o.device != "cuda", "it shapes how the GPUs run (--device cuda), and --device is " + o.device);
    refuse_inert("--no-communication-stream", o.comm != "nccl" && o.comm != "mpi-nccl",
                 "it sets where NCCL calls run (--comm nccl or mpi-nccl), and --comm is " + o.comm);
    refuse_inert("--sequence-parallel", o.tp == 1,
                 "it splits the rows between the layers over the tensor-parallel ranks, and --tp is 1");
    refuse_inert("--prefetch", o.zero != 3,
                 "it gathers ZeRO-3's parameters ahead, and --zero is " + std::to_string(o.zero));
    refuse_inert("--zero-replicas", o.zero == 0,
                 "it splits ZeRO's data-parallel ranks into sharded copies of the model, and --zero is 0");
    refuse_inert("--pad-token", o.pad_min == 0,
                 "it is what padded positions read, and --pad-min is 0: nothing is padded");
    refuse_inert("--pad-min", o.pad_min > o.seq,
                 "rows are drawn from [--pad-min, --seq] tokens, and --seq is " + std::to_string(o.seq));
    refuse_inert("--stop-after", o.stop_after > o.steps,
                 "must be at most --steps (" + std::to_string(o.steps) + "), where the run ends anyway");
    refuse_inert("--resume-if-exists", o.resume.empty(), "it says what --resume does without its file, and there is no --resume");
    refuse_inert("--no-save-on-signal", o.save_state.empty(),
                 "a signal stops the run to save --save-state, and there is none: it ends the process as usual");
    refuse_inert("--min-lr-factor", o.lr_decay == "constant",
                 "it is where the decay ends, and --lr-decay constant does not decay");
    for (const char* flag : {"--wsd-decay-steps", "--wsd-cooldown"})
      refuse_inert(flag, o.lr_decay != "wsd",
                   "it shapes a warmup-stable-decay schedule, and --lr-decay is " + o.lr_decay);
    // Refuses a schedule that does not fit the run, before any rank starts.
    if (!gpt2_example::lr_schedule(o).has_end() && app.count("--lr-decay-steps") > 0)
      throw loom::Error("--lr-decay-steps", std::to_string(o.lr_decay_steps),
                        "--lr-decay " + o.lr_decay + " has no end step to set");
    for (const char* flag : {"--adam-beta1", "--adam-beta2", "--adam-eps"})
      refuse_inert(flag, o.optimizer != "adamw", "it sets AdamW's hyper-parameters, and --optimizer is " + o.optimizer);
    if (o.optimizer == "adamw") gpt2_example::adam_options(o).validate();
    if (o.save_every > 0 && o.save_state.empty())
      throw loom::Error("--save-every", std::to_string(o.save_every), "needs --save-state (where to write it)");
    refuse_inert("--async-save", o.save_every == 0,
                 "it writes the --save-every saves in the background, and there are none (the save at the end waits "
                 "anyway)");
    refuse_inert("--keep-last", o.keep_last > 0 && !loom::io::CheckpointSeries::is_pattern(o.save_state),
                 "it deletes the older files of a --save-state series (a name holding {step}), and " +
                     (o.save_state.empty() ? std::string("there is no --save-state")
                                           : "--save-state " + o.save_state + " is one file"));
    // A pattern's mistakes (two {step}, one in a directory) are found before any rank starts.
    if (loom::io::CheckpointSeries::is_pattern(o.save_state)) (void)loom::io::CheckpointSeries(o.save_state, "--save-state");
    if (loom::io::CheckpointSeries::is_pattern(o.resume)) (void)loom::io::CheckpointSeries(o.resume, "--resume");
    for (const char* flag : {"--prompt", "--temperature", "--top-k", "--sample-every", "--tokenizer", "--samples"})
      refuse_inert(flag, o.sample_tokens == 0,
                   "it shapes the sample that --sample-tokens N asks for, and there is none");
#if !LOOM_EXAMPLE_BERT
    if (!o.tokenizer.empty()) gpt2_example::check_tokenizer(o);
#endif
    if (o.val_data.empty() && (app.count("--eval-every") > 0 || app.count("--eval-batches") > 0))
      throw loom::Error(app.count("--eval-every") > 0 ? "--eval-every" : "--eval-batches",
                        std::to_string(app.count("--eval-every") > 0 ? o.eval_every : o.eval_batches),
                        "needs --val-data (the held-out data to validate on)");
    if (o.val_data == "synthetic" && o.data != "synthetic")
      throw loom::Error("--val-data", o.val_data,
                        "synthetic validation holds out the synthetic task's own sequences, and --data is " + o.data +
                            ": give a held-out file of the same tokenizer");
    if ((o.comm == "nccl" || o.comm == "mpi-nccl") && o.device != "cuda")
      throw loom::Error("--comm", o.comm, "NCCL moves GPU buffers: it needs --device cuda");
    // With --save-state, the first SIGINT, SIGTERM or SIGUSR1 stops the run after the step under
    // way, on every rank, and saves it (run_training polls; docs/checkpoints.md).
    std::optional<loom::StopSignals> signals;
    if (!o.save_state.empty() && !o.no_save_on_signal)
      signals.emplace(gpt2_example::program,
                      "the run stops after the step under way and saves its training state (a second signal ends "
                      "it at once)");
    return o.device == "cuda" ? gpt2_example::run_cuda(o, argc, argv) : run_cpu(o, argc, argv);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
