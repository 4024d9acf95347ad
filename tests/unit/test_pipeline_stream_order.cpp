// Whether the executor runs every pipeline schedule over NCCL, found on the CPU: NCCL has no tags
// (point-to-point messages between two ranks match in the order they were issued) and it runs
// every operation of a rank in order on the rank's stream, so a send holds up everything the rank
// issued after it until its receiver has posted the matching receive; only the sends and
// receives of one group (ncclGroupStart/End) progress together. StreamOrderCommunicator gives
// thread ranks exactly those rules; a schedule whose messages would match wrongly fails with the
// tags that NCCL would have mixed up, and one that would deadlock times out.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loom/comm/any.hpp"
#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/pipeline_parity.hpp"

namespace test_pipeline_stream_order {

using namespace loom;
using namespace loom::test;

namespace {

//! Thread ranks under NCCL's ordering rules. Every operation, or group of sends and receives,
//! completes before the next starts (one stream); a send completes when its receiver has taken
//! it (rendezvous: the receiver acknowledges); sends and receives between two ranks match in
//! issue order whatever their tags, and a receive that gets a message tagged otherwise than it
//! asked throws, naming both. Within a group every send is offered before any receive waits, and
//! the group ends when its receives have arrived and its sends have been taken.
class StreamOrderCommunicator : public CollectiveInterface<StreamOrderCommunicator> {
 public:
  using loom_communicator = void;
  static constexpr bool point_to_point_in_issue_order = true;
  explicit StreamOrderCommunicator(threads::Communicator inner) : inner_(std::move(inner)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }

  void run(const CollectiveCall& call) {
    if (call.kind == Collective::send || call.kind == Collective::recv)
      start_group(std::span<const CollectiveCall>(&call, 1));
    else
      inner_.run(call);
  }
  //! Runs `call` to completion: the stream would not start anything after it before it ends.
  Request start(const CollectiveCall& call) {
    run(call);
    return Request();
  }
  //! Runs the group to completion.
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) {
    check_group(calls);
    std::erase_if(acknowledgements_, [](Request& r) { return r.test(); });
    std::vector<float> tags;  // headers: each send's tag, ahead of its payload on one inner tag
    tags.reserve(calls.size());
    std::vector<Request> offered;
    for (const CollectiveCall& call : calls)
      if (call.kind == Collective::send) {
        tags.push_back(static_cast<float>(call.tag));
        offered.push_back(inner_.send_async(std::span<const float>(&tags.back(), 1), call.peer, message_tag));
        CollectiveCall payload = call;
        payload.tag = message_tag;
        offered.push_back(inner_.start(payload));
      }
    for (const CollectiveCall& call : calls)
      if (call.kind == Collective::recv) {
        float tag = 0;
        inner_.recv(std::span<float>(&tag, 1), call.peer, message_tag);
        if (static_cast<int>(tag) != call.tag)
          throw Error("stream-order recv: rank " + std::to_string(rank()) + " from rank " + std::to_string(call.peer) +
                          ": asked for the message tagged " + std::to_string(call.tag),
                      static_cast<int>(tag),
                      "NCCL would deliver this message (issued first between the two ranks) instead");
        CollectiveCall payload = call;
        payload.tag = message_tag;
        inner_.run(payload);
        // The sender takes the acknowledgement after its group's own receives: not waited for.
        acknowledgements_.push_back(inner_.send_async(std::span<const float>(&acknowledgement, 1), call.peer, ack_tag));
      }
    for (const CollectiveCall& call : calls)
      if (call.kind == Collective::send) {
        float ack = 0;
        inner_.recv(std::span<float>(&ack, 1), call.peer, ack_tag);
      }
    wait_all(offered);
    return std::vector<Request>(calls.size());
  }
  StreamOrderCommunicator split(int color, int key) { return StreamOrderCommunicator(inner_.split(color, key)); }

 private:
  static constexpr int message_tag = 0, ack_tag = 1;
  static constexpr float acknowledgement = 1;
  threads::Communicator inner_;
  std::vector<Request> acknowledgements_;  // sent, not yet taken
};
static_assert(Communicator<StreamOrderCommunicator>);

//! parity_steps steps of schedule `S` on `shape` under NCCL's rules: "" when they match one
//! rank's, else every rank's error or parity failure. A rank waiting longer than `timeout` for a
//! peer fails (a deadlock). `erased`: the mesh is over an AnyCommunicator holding the
//! communicator, whose type no longer says that point-to-point runs in issue order. `strategy`
//! reduces over the data-parallel ranks (its collectives run in issue order too).
template <class S, class St = DataParallel>
std::string stream_order_outcome(MeshShape shape, S schedule, std::chrono::milliseconds timeout, bool erased = false,
                                 St strategy = DataParallel{.bucket_bytes = 4096}) {
  using Gpt = gpt2::Model<cpu, float>;
  const Gpt global_model(pipeline_config());
  const ParityRun& reference = pipeline_reference(0.0);  // before the rank threads: computed once
  std::mutex mutex;
  std::string outcome;
  const auto train = [&](auto& mesh) {
    cpu be(1);
    Trainer<Gpt, AdamW, S, St> trainer(be, mesh, Gpt(pipeline_config(), mesh.tensor_parallel()),
                                       AdamW({.weight_decay = 0.1}), parity_lr(), pipeline_options(0.0), strategy,
                                       schedule);
    const ParityRun run = train_steps(trainer, pipeline_global_batch, pipeline_seq);
    std::string failure = parity_failures(trainer, run, reference, global_model.layout());
    // evaluate() sends forward only, micro-batch by micro-batch: the one-rank model with the
    // trained weights gives the same loss (the weights are whole without tensor parallelism).
    if (failure.empty() && shape.tp == 1) {
      const auto batch = make_batch(parity_steps, pipeline_global_batch, pipeline_seq, pipeline_config().vocab_size);
      const double got = trainer.evaluate(batch);
      Trainer<Gpt, AdamW> one(be, Gpt(pipeline_config()), AdamW(), parity_lr(),
                              pipeline_options(0.0, pipeline_global_batch));
      one.load_parameters(run.weights);
      const double want = one.evaluate(batch);
      if (!(std::abs(got - want) <= 1e-5 * std::abs(want)))
        failure = "evaluate " + std::to_string(got) + ", one rank " + std::to_string(want);
    }
    return failure;
  };
  threads::run(
      shape.size(),
      [&](threads::Communicator& world) {
        std::string failure;
        try {
          StreamOrderCommunicator ordered(world.split(0, world.rank()));
          if (erased) {
            AnyCommunicator any(std::move(ordered));
            Mesh<AnyCommunicator> mesh(any, shape);
            failure = train(mesh);
          } else {
            Mesh<StreamOrderCommunicator> mesh(ordered, shape);
            failure = train(mesh);
          }
        } catch (const std::exception& e) {
          failure = e.what();
        }
        std::lock_guard lock(mutex);
        if (!failure.empty()) outcome += "\n  rank " + std::to_string(world.rank()) + ": " + failure;
      },
      CommOptions{.timeout = timeout});
  return outcome;
}

//! A deadlock shows as a timeout: 60 s, or LOOM_TEST_STREAM_ORDER_TIMEOUT_MS.
std::chrono::milliseconds stream_order_timeout() {
  const char* ms = std::getenv("LOOM_TEST_STREAM_ORDER_TIMEOUT_MS");
  return std::chrono::milliseconds(ms != nullptr ? std::atoi(ms) : 60000);
}

}  // namespace

TEST_CASE("under NCCL's ordering rules every pipeline schedule trains as one rank on every pipeline shape") {
  // Before the executor issued each send in one group with the next action's receive, 1F1B and
  // ZB-H1 deadlocked here: stage 0 sent micro-batch 1's activation while the last stage sent
  // micro-batch 0's gradient, each send waiting for a receive the other rank had queued behind
  // its own send. Interleaved 1F1B needs more: the pipeline wraps around (virtual stage 1 on
  // rank 1 feeds stage 2 on rank 0), so two ranks come to hold a gradient send to each other at
  // once; it runs with each forward and the backward after it as one unit, the unit's sends in
  // one group with the next unit's receives (Megatron-LM's steady state).
  const auto trains_as_one_rank = [](MeshShape shape, auto schedule, std::string schedule_name) {
    CAPTURE(shape);
    CAPTURE(schedule_name);
    const std::string outcome = stream_order_outcome(shape, schedule, stream_order_timeout());
    CHECK_MESSAGE(outcome.empty(), outcome);
  };
  for (const MeshShape shape : {MeshShape{.dp = 1, .tp = 1, .pp = 2}, MeshShape{.dp = 1, .tp = 1, .pp = 4},
                                MeshShape{.dp = 2, .tp = 1, .pp = 2}, MeshShape{.dp = 1, .tp = 2, .pp = 2}}) {
    trains_as_one_rank(shape, GPipe{}, "GPipe");
    trains_as_one_rank(shape, OneFOneB{}, "1F1B");
    trains_as_one_rank(shape, ZeroBubbleH1{}, "ZB-H1");
  }
  // Held by an AnyCommunicator (as gpt2_train holds NCCL), the communicator trains as one rank.
  const std::string erased =
      stream_order_outcome(MeshShape{.dp = 1, .tp = 1, .pp = 2}, OneFOneB{}, stream_order_timeout(), true);
  CHECK_MESSAGE(erased.empty(), erased);
  for (const MeshShape shape : {MeshShape{.dp = 1, .tp = 1, .pp = 2}, MeshShape{.dp = 2, .tp = 1, .pp = 2},
                                MeshShape{.dp = 1, .tp = 2, .pp = 2}})
    trains_as_one_rank(shape, Interleaved1F1B{.virtual_stages = 2}, "interleaved v2");
}

TEST_CASE("under NCCL's ordering rules ZeRO-2 and ZeRO-3 train as one rank under every pipeline schedule") {
  // The data-parallel ranks of a stage issue their gathers and reduce-scatters in one order
  // between the stage's sends and receives; under ZeRO-3 the tied wte's unit is reduce-scattered
  // once, after the exchange across the stages, and with 2 copies its piece is then summed across
  // them.
  const MeshShape shape{.dp = 2, .tp = 1, .pp = 2};
  const auto trains_as_one_rank = [&](auto schedule, auto strategy, std::string name) {
    CAPTURE(name);
    const std::string outcome = stream_order_outcome(shape, schedule, stream_order_timeout(), false, strategy);
    CHECK_MESSAGE(outcome.empty(), outcome);
  };
  trains_as_one_rank(OneFOneB{}, Zero<3>{}, "1F1B, Zero<3>");
  trains_as_one_rank(ZeroBubbleH1{}, Zero<2>{.bucket_bytes = 4096}, "ZB-H1, Zero<2>");
  trains_as_one_rank(Interleaved1F1B{.virtual_stages = 2}, Zero<3>{.replicas = 2}, "interleaved v2, Zero<3> x2");
}

namespace {

//! GPipe with the last stage's backwards in reverse order: correct with tags (every message
//! names its micro-batch), but without them stage 0's first gradient receive would get the
//! last micro-batch's gradient, whichever way the sends and receives are grouped.
struct ReversedLastBackwards {
  using loom_schedule = void;
  static constexpr bool pipelined = true;
  std::vector<Action> actions(const ScheduleShape& shape) const {
    std::vector<Action> out = GPipe{}.actions(shape);
    if (shape.stage == shape.stages - 1)
      std::reverse(out.begin() + static_cast<std::ptrdiff_t>(shape.micro_batches), out.end());
    return out;
  }
  std::int64_t live_micro_batches(const ScheduleShape& shape) const { return shape.micro_batches; }
};

}  // namespace

TEST_CASE("a schedule that no grouping completes under NCCL's ordering rules is refused before anything is sent") {
  // The Trainer models every rank's groups when it plans a step shape; it needs no timeout.
  const std::string outcome =
      stream_order_outcome(MeshShape{.dp = 1, .tp = 1, .pp = 2}, ReversedLastBackwards{}, std::chrono::seconds(60));
  CHECK_MESSAGE(outcome.find("over a communicator that runs point-to-point in issue order (NCCL): got would "
                             "deadlock; grouped per action: rank 0: recv g0 for stage 0 from rank 1 would get rank "
                             "1's send g15 for stage 0 to rank 0") != std::string::npos,
                outcome);
  CHECK_MESSAGE(outcome.find("; grouped per unit: ") != std::string::npos, outcome);
  // The same through an AnyCommunicator, whose type hides the rule: it answers at run time.
  static_assert(!point_to_point_in_issue_order<AnyCommunicator>);
  const std::string erased = stream_order_outcome(MeshShape{.dp = 1, .tp = 1, .pp = 2}, ReversedLastBackwards{},
                                                  std::chrono::seconds(60), true);
  CHECK_MESSAGE(erased.find("over a communicator that runs point-to-point in issue order (NCCL): got would "
                            "deadlock") != std::string::npos,
                erased);
  // With tags the same schedule trains as one rank.
  check_pipeline_mesh(MeshShape{.dp = 1, .tp = 1, .pp = 2}, 0.0, ReversedLastBackwards{}, DataParallel{.bucket_bytes = 4096});
}

namespace {

//! Every rank's executor groups for schedule `S` on `p` ranks, `m` micro-batches, `v` chunks,
//! grouped `g`.
template <class S>
std::string modelled_outcome(const S& schedule, int p, std::int64_t m, int v,
                             detail::MessageGrouping g = detail::MessageGrouping::per_action) {
  std::vector<std::vector<detail::PlannedGroup>> by_rank;
  for (int s = 0; s < p; ++s) {
    const ScheduleShape shape{.stages = p, .stage = s, .micro_batches = m, .virtual_stages = v};
    by_rank.push_back(detail::executor_groups(schedule.actions(shape), shape, g));
  }
  return detail::in_order_deadlock(by_rank);
}

//! The grouping the Trainer would choose for schedule `S`.
template <class S>
std::optional<detail::MessageGrouping> chosen(const S& schedule, int p, std::int64_t m, int v = 1) {
  const ScheduleShape shape{.stages = p, .stage = 0, .micro_batches = m, .virtual_stages = v};
  std::vector<std::vector<Action>> actions;
  for (int s = 0; s < p; ++s) {
    ScheduleShape theirs = shape;
    theirs.stage = s;
    actions.push_back(schedule.actions(theirs));
  }
  return detail::choose_grouping(actions, shape).safe;
}

detail::PlannedMessage message(bool send, int peer, std::int64_t micro_batch) {
  return {.send = send, .peer = peer, .direction = 0, .micro_batch = micro_batch, .to_stage = 1};
}

}  // namespace

TEST_CASE("the model of NCCL's rules: every schedule has a grouping that completes, and it is the one chosen") {
  using detail::MessageGrouping;
  for (int p : {2, 3, 4, 8})
    for (std::int64_t m : {std::int64_t{1}, std::int64_t{p}, std::int64_t{2 * p + 1}, std::int64_t{4 * p}}) {
      CAPTURE(p);
      CAPTURE(m);
      CHECK(modelled_outcome(GPipe{}, p, m, 1).empty());
      CHECK(modelled_outcome(OneFOneB{}, p, m, 1).empty());
      CHECK(modelled_outcome(ZeroBubbleH1{}, p, m, 1).empty());
      CHECK(chosen(GPipe{}, p, m) == MessageGrouping::per_action);
      CHECK(chosen(OneFOneB{}, p, m) == MessageGrouping::per_action);
      CHECK(chosen(ZeroBubbleH1{}, p, m) == MessageGrouping::per_action);
      // Grouping by units does not suit GPipe: all forwards, then all backwards.
      if (p >= 2 && m >= 2) CHECK_FALSE(modelled_outcome(GPipe{}, p, m, 1, MessageGrouping::per_unit).empty());
    }
  // Interleaved: with m = p micro-batches (no steady state) the sends can go per action, and
  // grouping by units would deadlock; from m = 2p on only units complete.
  for (int p : {2, 3, 4, 8})
    for (int v : {2, 3, 4})
      for (std::int64_t m : {std::int64_t{p}, std::int64_t{2 * p}, std::int64_t{3 * p}, std::int64_t{4 * p}}) {
        CAPTURE(p);
        CAPTURE(v);
        CAPTURE(m);
        const Interleaved1F1B schedule{.virtual_stages = v};
        const std::string per_action = modelled_outcome(schedule, p, m, v);
        const std::string per_unit = modelled_outcome(schedule, p, m, v, MessageGrouping::per_unit);
        if (m == p) {
          CHECK_MESSAGE(per_action.empty(), per_action);
          CHECK(chosen(schedule, p, m, v) == MessageGrouping::per_action);
          if (p > 2) CHECK_MESSAGE(per_unit.find("waits in {") != std::string::npos, per_unit);
        } else {
          CHECK_MESSAGE(per_action.find("waits in {") != std::string::npos, per_action);
          CHECK_MESSAGE(per_unit.empty(), per_unit);
          CHECK(chosen(schedule, p, m, v) == MessageGrouping::per_unit);
        }
      }
}

TEST_CASE("a plan puts each send in the group before the next unit, with that unit's receives") {
  using detail::MessageGrouping;
  // Stage 0 of 2 under 1F1B with 2 micro-batches: F0, then F1 B0 (a unit), then B1.
  const ScheduleShape shape{.stages = 2, .stage = 0, .micro_batches = 2, .virtual_stages = 1};
  const std::vector<Action> actions = OneFOneB{}.actions(shape);
  REQUIRE(actions.size() == 4);
  const auto text = [](const std::vector<detail::PlannedGroup>& plan) {
    std::string out;
    for (const auto& g : plan) {
      out += "[";
      for (std::size_t c = 0; c < g.size(); ++c) out += (c ? ", " : "") + g[c].text();
      out += "]";
    }
    return out;
  };
  CHECK(text(detail::message_plan(actions, shape, MessageGrouping::per_action)) ==
        "[][send a0 for stage 1 to rank 1][send a1 for stage 1 to rank 1, recv g0 for stage 0 from rank 1]"
        "[recv g1 for stage 0 from rank 1][]");
  // Per unit, B0's gradient is received before F1 computes, with F0's send.
  CHECK(text(detail::message_plan(actions, shape, MessageGrouping::per_unit)) ==
        "[][send a0 for stage 1 to rank 1, recv g0 for stage 0 from rank 1][][send a1 for stage 1 to rank 1, recv g1 "
        "for stage 0 from rank 1][]");
}

TEST_CASE("the model of NCCL's rules finds crossed sends, messages out of order, and unmatched ones") {
  using Groups = std::vector<std::vector<detail::PlannedGroup>>;
  // Each rank sends to the other first, alone: both wait.
  const Groups crossed{{{message(true, 1, 0)}, {message(false, 1, 0)}}, {{message(true, 0, 0)}, {message(false, 0, 0)}}};
  CHECK(detail::in_order_deadlock(crossed) ==
        "rank 0 waits in {send a0 for stage 1 to rank 1}; rank 1 waits in {send a0 for stage 1 to rank 0}");
  // The same as one group on each rank: both complete.
  const Groups grouped{{{message(true, 1, 0), message(false, 1, 0)}}, {{message(false, 0, 0), message(true, 0, 0)}}};
  CHECK(detail::in_order_deadlock(grouped).empty());
  // Sent 0 then 1, received 1 then 0: without tags the first receive gets message 0.
  const Groups swapped{{{message(true, 1, 0)}, {message(true, 1, 1)}}, {{message(false, 0, 1)}, {message(false, 0, 0)}}};
  CHECK(detail::in_order_deadlock(swapped) ==
        "rank 1: recv a1 for stage 1 from rank 0 would get rank 0's send a0 for stage 1 to rank 1 (sent in that order, "
        "and point-to-point has no tags)");
  const Groups unmatched{{{message(true, 1, 0)}}, {}};
  CHECK(detail::in_order_deadlock(unmatched) == "rank 0: send a0 for stage 1 to rank 1 is never received");
}

}  // namespace test_pipeline_stream_order
